"""Multi30k (task 1, raw) as a tensorflow-datasets builder.

Reads `{train,val,test_2016_flickr}.{en,de,fr,cs}` from a local directory
(TFDS `manual_dir`) and otherwise downloads the gzipped files from
github.com/multi30k/dataset (data/task1/raw/<split>.<lang>.gz) when online.
One builder config per language pair, e.g. `multi30k/de-en`.
"""

from __future__ import annotations

import inspect
import itertools
import logging

import tensorflow_datasets as tfds
from etils import epath

from training.data import (HOW_TO_GET_MULTI30K, MULTI30K_LANGS, MULTI30K_SPLITS, MULTI30K_URL,
                           check_multi30k_dir, read_parallel_files, resolve_multi30k_dir)
from training.errors import DataError

log = logging.getLogger("training.multi30k")

_CITATION = """@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30K: Multilingual English-German Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016}, pages = {70--74}, doi = {10.18653/v1/W16-3210}}"""


def pair_name(lang_a: str, lang_b: str) -> str:
    a, b = sorted((lang_a, lang_b))
    return f"{a}-{b}"


class Multi30kConfig(tfds.core.BuilderConfig):
    def __init__(self, *, languages, **kwargs):
        super().__init__(name="-".join(languages), description=f"Multi30k task 1, {'/'.join(languages)}", **kwargs)
        self.languages = tuple(languages)


class Multi30k(tfds.core.GeneratorBasedBuilder):
    """Multi30k task 1 raw text (29,000 train / 1,014 validation / 1,000 test_2016_flickr)."""

    VERSION = tfds.core.Version("1.1.0")
    RELEASE_NOTES = {"1.0.0": "Raw task-1 text; empty line pairs are skipped.",
                     "1.1.0": "Examples keep the files' line order (test sets align with sacreBLEU's)."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = HOW_TO_GET_MULTI30K
    BUILDER_CONFIGS = [Multi30kConfig(languages=sorted(p)) for p in itertools.combinations(MULTI30K_LANGS, 2)]

    # Work around tensorflow-datasets 4.9.10: its default `code_path` needs the
    # `importlib_resources` backport, which is not installed (ModuleNotFoundError).
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(inspect.getfile(cls))

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            description="Multi30k: image descriptions translated between English, German, French and Czech.",
            features=tfds.features.Translation(languages=self.builder_config.languages),
            supervised_keys=self.builder_config.languages,
            homepage="https://github.com/multi30k/dataset",
            citation=_CITATION,
            # Keep file order: hypotheses written in dataset order then line up with
            # the raw reference files (and sacreBLEU's multi30k/2016). Training
            # shuffles in tf.data.
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager):
        langs = self.builder_config.languages
        try:
            manual_dir = dl_manager.manual_dir
        except AssertionError:
            manual_dir = None
        if manual_dir is not None:
            check_multi30k_dir(manual_dir, langs)
            paths = {(s, l): manual_dir / f"{prefix}.{l}" for s, prefix in MULTI30K_SPLITS.items() for l in langs}
        else:
            urls = {f"{prefix}.{l}": MULTI30K_URL.format(prefix=prefix, lang=l)
                    for prefix in MULTI30K_SPLITS.values() for l in langs}
            files = dl_manager.download_and_extract(urls)
            paths = {(s, l): files[f"{prefix}.{l}"] for s, prefix in MULTI30K_SPLITS.items() for l in langs}
        a, b = langs
        return {split: self._generate_examples(paths[(split, a)], paths[(split, b)]) for split in MULTI30K_SPLITS}

    def _generate_examples(self, path_a, path_b):
        a, b = self.builder_config.languages
        text_a, text_b, _ = read_parallel_files(path_a, path_b)
        for i, (x, y) in enumerate(zip(text_a, text_b)):
            yield i, {a: x, b: y}


def prepare_multi30k(source_lang: str, target_lang: str, *, data_dir=None, tfds_data_dir=None) -> Multi30k:
    """Builds (once per `tfds_data_dir`) and returns the Multi30k builder for a language pair."""
    for lang in (source_lang, target_lang):
        if lang not in MULTI30K_LANGS:
            raise DataError(f"Multi30k has languages {MULTI30K_LANGS}, not {lang!r}.")
    raw_dir = resolve_multi30k_dir(data_dir)
    builder = Multi30k(config=pair_name(source_lang, target_lang), data_dir=tfds_data_dir)
    if raw_dir is not None:
        check_multi30k_dir(raw_dir, (source_lang, target_lang))
    download_config = tfds.download.DownloadConfig(manual_dir=str(raw_dir.resolve()) if raw_dir else None)
    builder.download_and_prepare(download_config=download_config)
    return builder
