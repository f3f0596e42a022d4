"""Parallel text sources: Multi30k (TFDS builder over local raw files), any TFDS
translation dataset by name, and plain parallel text files.

Every source ends up as a `tf.data.Dataset` of `(source_text, target_text)`
scalar string pairs.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from training.errors import DataError, DataNotFoundError, LineCountMismatchError

log = logging.getLogger("training.data")

MULTI30K_LANGS = ("en", "de", "fr", "cs")
# Split name used by this project -> file prefix of the raw Multi30k files.
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test_2016_flickr": "test_2016_flickr"}
SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "test": "test_2016_flickr"}
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{prefix}.{lang}.gz"
MULTI30K_ENV = "KT_MULTI30K_DIR"
TFDS_DIR_ENV = "KT_TFDS_DIR"

HOW_TO_GET_MULTI30K = (
    "Multi30k is the task-1 raw data of https://github.com/multi30k/dataset "
    "(data/task1/raw/{train,val,test_2016_flickr}.{en,de,fr,cs}.gz). Download and gunzip "
    "those files into one directory and pass it with --data-dir DIR or the environment "
    f"variable {MULTI30K_ENV}=DIR; or, on a machine that is online, omit --data-dir and "
    "the files are downloaded by the TFDS builder."
)


@dataclass
class ReadStats:
    """What happened while reading a parallel corpus."""

    lines: int = 0
    kept: int = 0
    empty_skipped: int = 0
    empty_line_numbers: list = field(default_factory=list)


def _read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":  # final newline
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_parallel_files(source_path, target_path) -> tuple[list[str], list[str], ReadStats]:
    """Reads two line-aligned files. Empty lines (either side) are skipped and counted.

    Raises `DataNotFoundError` if a file is missing and `LineCountMismatchError`
    (naming both files and both counts) if the line counts differ. Lines are kept
    verbatim (inner tabs included), only the line terminator is removed.
    """
    source_path, target_path = Path(source_path), Path(target_path)
    for p in (source_path, target_path):
        if not p.is_file():
            raise DataNotFoundError(f"Parallel text file not found: {p}")
    src, tgt = _read_lines(source_path), _read_lines(target_path)
    if len(src) != len(tgt):
        raise LineCountMismatchError(
            f"Line counts differ: {source_path} has {len(src)} lines but {target_path} has "
            f"{len(tgt)} lines. The two files must be line-aligned translations."
        )
    stats = ReadStats(lines=len(src))
    out_src, out_tgt = [], []
    for i, (s, t) in enumerate(zip(src, tgt), start=1):
        if not s.strip() or not t.strip():
            stats.empty_skipped += 1
            if len(stats.empty_line_numbers) < 20:
                stats.empty_line_numbers.append(i)
            continue
        out_src.append(s)
        out_tgt.append(t)
    stats.kept = len(out_src)
    if stats.empty_skipped:
        log.warning(
            "Skipped %d empty line pair(s) in %s / %s (line numbers, first 20: %s); kept %d of %d.",
            stats.empty_skipped, source_path, target_path, stats.empty_line_numbers,
            stats.kept, stats.lines,
        )
    if stats.kept == 0:
        raise DataError(f"No non-empty line pairs in {source_path} / {target_path}.")
    return out_src, out_tgt, stats


def _repo_default_multi30k_dir() -> Path:
    # The repository lives next to ../shared (see Makefile); also try relative to cwd.
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


def resolve_multi30k_dir(data_dir: str | os.PathLike | None = None, *, required: bool = False) -> Path | None:
    """Where the raw Multi30k files are: `data_dir`, else $KT_MULTI30K_DIR, else
    ../shared/data/multi30k if it exists, else None (download when online).

    A directory that was asked for explicitly (argument or environment variable)
    but does not exist raises `DataNotFoundError` saying how to get the data.
    """
    explicit = data_dir if data_dir else os.environ.get(MULTI30K_ENV) or None
    if explicit:
        path = Path(explicit).expanduser()
        origin = "--data-dir" if data_dir else f"${MULTI30K_ENV}"
        if not path.is_dir():
            raise DataNotFoundError(f"Multi30k data directory {path} (from {origin}) does not exist. {HOW_TO_GET_MULTI30K}")
        return path
    for candidate in (Path.cwd().parent / "shared" / "data" / "multi30k", _repo_default_multi30k_dir()):
        if candidate.is_dir():
            return candidate
    if required:
        raise DataNotFoundError(f"No Multi30k data directory found. {HOW_TO_GET_MULTI30K}")
    return None


def canonical_split(split: str) -> str:
    return SPLIT_ALIASES.get(split, split)


def multi30k_files(data_dir: Path, split: str, lang: str) -> Path:
    split = canonical_split(split)
    if split not in MULTI30K_SPLITS:
        raise DataError(f"Unknown Multi30k split {split!r}; choose from {sorted(MULTI30K_SPLITS)}.")
    return Path(data_dir) / f"{MULTI30K_SPLITS[split]}.{lang}"


def check_multi30k_dir(data_dir: Path, langs, splits=tuple(MULTI30K_SPLITS)) -> None:
    """Raises a clear error if any raw file needed is missing."""
    missing = [str(multi30k_files(data_dir, s, l)) for s in splits for l in langs
               if not multi30k_files(data_dir, s, l).is_file()]
    if missing:
        raise DataNotFoundError(
            f"Multi30k directory {data_dir} lacks {len(missing)} file(s): {', '.join(missing)}. "
            + HOW_TO_GET_MULTI30K)


# --------------------------------------------------------------------------
# tf.data sources


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

    def to_json(self) -> dict:
        return {"dataset": self.dataset, "source_lang": self.source_lang, "target_lang": self.target_lang,
                "data_dir": self.data_dir, "tfds_data_dir": self.tfds_data_dir, "files": self.files}


def tfds_data_dir(spec: DataSpec) -> str | None:
    return spec.tfds_data_dir or os.environ.get(TFDS_DIR_ENV) or None


def load_text_pairs(spec: DataSpec, split: str, *, max_examples: int | None = None):
    """A `tf.data.Dataset` of `(source_text, target_text)` string scalars for `split`."""
    import tensorflow as tf

    src_lang, tgt_lang = spec.source_lang, spec.target_lang
    if src_lang == tgt_lang:
        raise DataError(f"Source and target language are both {src_lang!r}.")
    if spec.dataset == "files":
        split = canonical_split(split)
        if not spec.files or split not in spec.files:
            raise DataError(f"No files given for split {split!r} (have: {sorted(spec.files or {})}).")
        src, tgt, _ = read_parallel_files(*spec.files[split])
        if max_examples:
            src, tgt = src[:max_examples], tgt[:max_examples]
        return tf.data.Dataset.from_tensor_slices((tf.constant(src), tf.constant(tgt)))

    if spec.dataset == "multi30k":
        from training.multi30k import prepare_multi30k

        builder = prepare_multi30k(src_lang, tgt_lang, data_dir=spec.data_dir, tfds_data_dir=tfds_data_dir(spec))
        ds = builder.as_dataset(split=canonical_split(split), shuffle_files=False)
    else:
        import tensorflow_datasets as tfds

        try:
            builder = tfds.builder(spec.dataset, data_dir=tfds_data_dir(spec))
        except Exception as e:  # unknown name etc.
            raise DataError(f"Cannot load TFDS dataset {spec.dataset!r}: {e}") from e
        builder.download_and_prepare()
        langs = getattr(builder.info.features, "languages", None) or list(builder.info.features.keys())
        for lang in (src_lang, tgt_lang):
            if lang not in langs:
                raise DataError(f"TFDS dataset {spec.dataset!r} has languages {list(langs)}, not {lang!r}.")
        ds = builder.as_dataset(split=split, shuffle_files=False)
    ds = ds.map(lambda ex: (ex[src_lang], ex[tgt_lang]), num_parallel_calls=tf.data.AUTOTUNE)
    if max_examples:
        ds = ds.take(max_examples)
    return ds


def iterate_text(ds, limit: int | None = None):
    """Yields python strings from both sides of a pair dataset (for vocabulary training)."""
    for i, (s, t) in enumerate(ds.as_numpy_iterator()):
        if limit is not None and i >= limit:
            break
        yield s.decode("utf-8")
        yield t.decode("utf-8")
