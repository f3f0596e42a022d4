"""Multi30k (task 1, raw) as a tensorflow-datasets builder.

Reads `{train,val,test_2016_flickr}.{en,de,fr,cs}` from a local directory
(TFDS `manual_dir`) and otherwise downloads the gzipped files from
github.com/multi30k/dataset (data/task1/raw/<split>.<lang>.gz) when online.
One builder config per language pair, e.g. `multi30k/de-en`.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: no lock
    fcntl = None

import tensorflow_datasets as tfds
from etils import epath

from training.errors import DataError, DataNotFoundError
from training.text_files import read_parallel_files

log = logging.getLogger("training.multi30k")

MULTI30K_LANGS = ("en", "de", "fr", "cs")
# Split name used by this project -> file prefix of the raw Multi30k files.
MULTI30K_SPLITS = {"train": "train", "validation": "val", "test_2016_flickr": "test_2016_flickr"}
SPLIT_ALIASES = {"val": "validation", "valid": "validation", "dev": "validation", "test": "test_2016_flickr"}
MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/{prefix}.{lang}.gz"
MULTI30K_ENV = "KT_MULTI30K_DIR"

HOW_TO_GET_MULTI30K = (
    "Multi30k is the task-1 raw data of https://github.com/multi30k/dataset "
    "(data/task1/raw/{train,val,test_2016_flickr}.{en,de,fr,cs}.gz). Download and gunzip "
    "those files into one directory and pass it with --data-dir DIR or the environment "
    f"variable {MULTI30K_ENV}=DIR; or, on a machine that is online, omit --data-dir and "
    "the files are downloaded by the TFDS builder."
)


def _repo_default_multi30k_dir() -> Path:
    # The repository lives next to ../shared (see Makefile); also try relative to cwd.
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "multi30k"


def resolve_multi30k_dir(data_dir: str | os.PathLike | None = None) -> Path | None:
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


@contextlib.contextmanager
def builder_lock(builder):
    """Holds a lock on a TFDS builder's dataset while its files are prepared.

    Two `kt-train` runs started together on a fresh machine (en->de and de->en, say) would otherwise both
    write the same `incomplete.*` directory, and one of them fail with TFDS' raw NotFoundError. An
    exclusive `fcntl.flock` on `.prepare.lock` beside the dataset's version directories: the second run
    waits, then finds the dataset prepared. Not taken for remote paths (gs://...) or without fcntl.
    """
    data_dir = str(builder.data_dir)
    if fcntl is None or "://" in data_dir:
        yield
        return
    path = Path(data_dir).parent / ".prepare.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("Waiting for another process that is preparing %s (lock %s).", builder.info.full_name,
                        path)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_and_prepare(builder, **kwargs):
    """`builder.download_and_prepare(**kwargs)` under `builder_lock`: one process at a time."""
    with builder_lock(builder):
        builder.download_and_prepare(**kwargs)


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
    download_and_prepare(builder, download_config=download_config)
    return builder
