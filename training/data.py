"""Parallel text sources: Multi30k (TFDS builder over local raw files), any TFDS
translation dataset by name, and plain parallel text files.

Every source ends up as a `tf.data.Dataset` of `(source_text, target_text)`
scalar string pairs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import tensorflow as tf
import tensorflow_datasets as tfds

from training.errors import DataError
from training.multi30k import canonical_split, download_and_prepare, prepare_multi30k
from training.text_files import read_parallel_files

log = logging.getLogger("training.data")

TFDS_DIR_ENV = "KT_TFDS_DIR"


@dataclass
class DataSpec:
    """Which parallel text to train/evaluate on.

    dataset: "multi30k", "files", or a TFDS name such as "ted_hrlr_translate/pt_to_en".
    """

    dataset: str = "multi30k"
    source_lang: str = "en"
    target_lang: str = "de"
    data_dir: str | None = None  # raw Multi30k directory (manual_dir)
    tfds_data_dir: str | None = None  # where TFDS keeps prepared datasets
    files: dict | None = None  # {"train": (src, tgt), "validation": (src, tgt), ...} for dataset="files"
    check_alignment: bool = True  # files: refuse pairs that look shifted (training.text_files.check_alignment)


def tfds_data_dir(spec: DataSpec) -> str | None:
    return spec.tfds_data_dir or os.environ.get(TFDS_DIR_ENV) or None


def load_text_pairs(spec: DataSpec, split: str, *, max_examples: int | None = None):
    """A `tf.data.Dataset` of `(source_text, target_text)` string scalars for `split`."""
    src_lang, tgt_lang = spec.source_lang, spec.target_lang
    if src_lang == tgt_lang:
        raise DataError(f"Source and target language are both {src_lang!r}.")
    if spec.dataset == "files":
        split = canonical_split(split)
        if not spec.files or split not in spec.files:
            raise DataError(f"No files given for split {split!r} (have: {sorted(spec.files or {})}).")
        src, tgt, _ = read_parallel_files(*spec.files[split], check_shift=spec.check_alignment)
        if max_examples:
            src, tgt = src[:max_examples], tgt[:max_examples]
        return tf.data.Dataset.from_tensor_slices((tf.constant(src), tf.constant(tgt)))

    # TFDS caches a small split in memory as it is read; a `take` after that cache stops it half-filled, and
    # tf.data warns and throws the part away. Reading part of a split, there is nothing to cache.
    read_config = tfds.ReadConfig(try_autocache=not max_examples)
    if spec.dataset == "multi30k":
        builder = prepare_multi30k(src_lang, tgt_lang, data_dir=spec.data_dir, tfds_data_dir=tfds_data_dir(spec))
        ds = builder.as_dataset(split=canonical_split(split), shuffle_files=False, read_config=read_config)
    else:
        try:
            builder = tfds.builder(spec.dataset, data_dir=tfds_data_dir(spec))
        except Exception as e:  # unknown name etc.
            raise DataError(f"Cannot load TFDS dataset {spec.dataset!r}: {e}") from e
        download_and_prepare(builder)
        langs = getattr(builder.info.features, "languages", None) or list(builder.info.features.keys())
        for lang in (src_lang, tgt_lang):
            if lang not in langs:
                raise DataError(f"TFDS dataset {spec.dataset!r} has languages {list(langs)}, not {lang!r}.")
        ds = builder.as_dataset(split=split, shuffle_files=False, read_config=read_config)
    ds = ds.map(lambda ex: (ex[src_lang], ex[tgt_lang]), num_parallel_calls=tf.data.AUTOTUNE)
    if max_examples:
        ds = ds.take(max_examples)
    return ds


def iterate_text(ds):
    """Yields python strings from both sides of a pair dataset (for vocabulary training)."""
    for s, t in ds.as_numpy_iterator():
        yield s.decode("utf-8")
        yield t.decode("utf-8")
