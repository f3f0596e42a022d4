"""kt-prepare: parallel corpora -> a vocabulary -> shuffled token-id shards and a manifest, once, for kt-train.

    kt-prepare --train-files europarl.en.gz europarl.de.gz --train-files news.en news.de \\
        --source-lang en --target-lang de --vocab-size 32000 --out data/en-de
    kt-train --prepared data/en-de --valid-files newstest2013.en newstest2013.de --model-dir runs/en-de

Memory stays flat in the corpus size: the corpora are read as streams, a chunk
of lines at a time; the vocabulary is trained on a uniform random sample of
all their lines (`--vocab-sample`, sentencepiece's reservoir sampling, on all
the machine's cores); every pair is tokenized once and dealt at random to one
of `--shards` scatter files (appended to), and each is then shuffled on
its own into a shard, so that each shard, and any run of pairs read from one,
is a uniform random sample of the whole. The format is
`training/prepared_corpus.py`'s.

A shard is built whole in memory (about 1 KB a pair) and kt-train pools at
least one shard at a time, so no shard holds more than about
`PAIRS_PER_SHARD` pairs: a corpus of more than `--shards` x `PAIRS_PER_SHARD`
pairs is written in a multiple of `--shards` shards (`shard_count`), each
scatter file dealt again, `PAIRS_PER_SHARD` pairs at a time, to that many
random shards. Memory stays flat at any size (BENCHMARKS.md, "Corpora of
millions of pairs"), and every shard is still a uniform random sample.

Run again with the same command, a finished directory is left as it is; a
killed one is prepared again from the start, keeping its vocabulary when that
was complete (the manifest, written last and atomically, tells which). The
shards and the vocabulary are flushed to the disk (fsync, and their
directory's entries) before the manifest is written: after a crash or a
power cut, a manifest names only files that are whole.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from common.native_logs import quiet_import_for_commands

# Before TensorFlow is imported (the vocabulary's module brings Keras): as a command, its C++ log lines stay out
# of the terminal.
quiet_import_for_commands(__name__)

import numpy as np  # noqa: E402
import sentencepiece as spm  # noqa: E402

from keras_transformer.text import (check_special_ids, lowercases, read_tokenizer_proto,  # noqa: E402
                                   train_sentencepiece, vocab_size_of)
from training.config import add_setting_flags, default  # noqa: E402
from training.errors import ConfigError, DataError  # noqa: E402
from training.prepared_corpus import (FORMAT, MANIFEST_FILENAME, SHARD_PATTERN, TARGET_VOCABULARY_FILENAME,  # noqa: E402
                                      VOCABULARY_FILENAME,
                                      file_sha256, fsync_directory, fsync_file, write_bytes_atomically,
                                      write_json_atomically)
from training.text_files import STREAM_CHUNK_LINES, ReadStats, iter_parallel_chunks  # noqa: E402

VOCABULARY_RECORD = "vocabulary.json"  # the vocabulary's request, written after tokenizer.model: it is complete
SCATTER_DIR = ".scatter"
DEFAULT_SHARDS = 64
# A shard's pairs, at most on average (the sampling's noise aside): kt-prepare builds a shard in memory, about 1 KB
# a pair, and kt-train pools shards of about `prepared_corpus.POOL_PAIRS` pairs, at least one, so the bound keeps
# both within a fixed memory whatever the corpus's size (a pool holds fewer than `POOL_PAIRS` + `PAIRS_PER_SHARD`
# pairs). 64 shards hold up to 6.4M pairs.
PAIRS_PER_SHARD = 100_000


def shard_count(pairs: int, requested: int) -> int:
    """The shards a corpus of `pairs` pairs is written in, with `--shards requested`: `requested`, or the least
    multiple of it whose shards hold at most `PAIRS_PER_SHARD` pairs each on average (a multiple: shards that
    divided among the workers still do)."""
    if requested < 1:
        raise ValueError(f"requested shards must be 1 or more, got {requested}")
    return requested * max(1, -(-pairs // (requested * PAIRS_PER_SHARD)))


def _corpus_request(corpus: dict) -> dict:
    """What identifies a corpus's content for "the same command": files by path, size and modification time."""
    if "files" in corpus:
        return {"files": [str(Path(p).resolve()) for p in corpus["files"]],
                "bytes": [Path(p).stat().st_size for p in corpus["files"]],
                "modified": [int(Path(p).stat().st_mtime) for p in corpus["files"]]}
    return dict(corpus)


def _log(message: str) -> None:
    print(f"[kt-prepare] {message}", flush=True)


def iter_corpus_chunks(corpus: dict, source_lang: str, target_lang: str, *, check_alignment: bool = True,
                       stats: ReadStats | None = None):
    """Yields `(source_lines, target_lines)` chunks of one corpus: `{"files": [SRC, TGT]}` or `{"tfds": NAME,
    "split": SPLIT}` (a TFDS translation dataset; "multi30k" is the project's own builder, with `data_dir`)."""
    if "files" in corpus:
        yield from iter_parallel_chunks(*corpus["files"], check_shift=check_alignment, stats=stats)
        return
    from training.data import DataSpec, load_text_pairs  # TensorFlow and TFDS: only for TFDS corpora
    spec = DataSpec(dataset=corpus["tfds"], source_lang=source_lang, target_lang=target_lang,
                    data_dir=corpus.get("data_dir"), tfds_data_dir=corpus.get("tfds_data_dir"))
    stats = stats if stats is not None else ReadStats()
    for src, tgt in load_text_pairs(spec, corpus.get("split", "train")).batch(STREAM_CHUNK_LINES).as_numpy_iterator():
        pairs = [(s.decode("utf-8"), t.decode("utf-8")) for s, t in zip(src, tgt)]
        kept = [(s, t) for s, t in pairs if s.strip() and t.strip()]
        stats.lines += len(pairs)
        stats.kept += len(kept)
        stats.empty_skipped += len(pairs) - len(kept)
        if kept:
            yield [s for s, _ in kept], [t for _, t in kept]


def _target_vocabulary(args, out: Path, vocab_size: int) -> bytes:
    """--target-tokenizer's sentencepiece model, checked (the special ids, the ids of --tokenizer's) and written
    to OUT/target_tokenizer.model."""
    proto = read_tokenizer_proto(args.target_tokenizer)
    try:
        check_special_ids(proto)
    except ValueError as e:
        raise ConfigError(f"--target-tokenizer {args.target_tokenizer}: {e}") from None
    if vocab_size_of(proto) != vocab_size:
        raise ConfigError(f"--target-tokenizer {args.target_tokenizer} has {vocab_size_of(proto):,} ids and "
                          f"--tokenizer {args.tokenizer} {vocab_size:,}: a vocabulary per side numbers one model's ids")
    write_bytes_atomically(out / TARGET_VOCABULARY_FILENAME, proto)
    _log(f"target vocabulary: {args.target_tokenizer} (--target-tokenizer: the targets are tokenized with it)")
    return proto


def _vocabulary(args, out: Path, corpora: list[dict]) -> bytes:
    """The vocabulary: --tokenizer's, the one a previous run of this command trained, or a new one."""
    path, record = out / VOCABULARY_FILENAME, out / VOCABULARY_RECORD
    if args.tokenizer:
        proto = read_tokenizer_proto(args.tokenizer)
        try:
            check_special_ids(proto)
        except ValueError as e:
            raise ConfigError(f"--tokenizer {args.tokenizer}: {e}") from None
        request = {"tokenizer": str(Path(args.tokenizer).resolve()), "sha256": file_sha256(args.tokenizer)}
    else:
        request = {"vocab_size": args.vocab_size, "vocab_type": args.vocab_type, "vocab_sample": args.vocab_sample,
                   "lowercase": args.lowercase, "seed": args.seed, "corpora": [_corpus_request(c) for c in corpora]}
    if path.is_file() and record.is_file() and json.loads(record.read_text()) == request:
        _log(f"vocabulary: {path} (from an earlier run of this command)")
        return path.read_bytes()
    record.unlink(missing_ok=True)
    if args.tokenizer:
        _log(f"vocabulary: {args.tokenizer} (--tokenizer)")
    else:
        spm.set_random_generator_seed(args.seed)  # seeds sentencepiece's sample of the lines
        t0, lines = time.time(), [0]

        def text():
            for corpus in corpora:
                for src, tgt in iter_corpus_chunks(corpus, args.source_lang, args.target_lang,
                                                   check_alignment=False):
                    lines[0] += 2 * len(src)
                    yield from src
                    yield from tgt

        try:
            proto = train_sentencepiece(text(), args.vocab_size, model_type=args.vocab_type,
                                        input_sentence_size=args.vocab_sample, lowercase=args.lowercase)
        except ValueError as e:
            raise ConfigError(f"{e} (--vocab-size)") from e
        sample = (f"a uniform random sample of {args.vocab_sample:,} of its {lines[0]:,} lines"
                  if lines[0] > args.vocab_sample else f"all its {lines[0]:,} lines")
        _log(f"vocabulary: {vocab_size_of(proto):,} pieces ({args.vocab_type})"
             f"{', case-folding' if lowercases(proto) else ''}, "
             f"trained on {sample}, both sides, in {time.time() - t0:.0f} s")
    write_bytes_atomically(path, proto)
    write_json_atomically(record, request)
    return proto


def _ids_array(pieces: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, pieces), np.int32, len(pieces))
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype, int(lengths.sum()))
    return ids, lengths


def _scatter_paths(scatter: Path, name: str) -> dict:
    return {array: scatter / f"{name}.{array}" for array in ("source_ids", "source_lengths", "target_ids",
                                                             "target_lengths")}


def _append_dealt(paths_of, dealt: np.ndarray, count: int, sides) -> None:
    """Appends pair i of `sides` (source, then target: (ids, lengths)) to the scatter files `paths_of(dealt[i])`,
    each file's pairs in their order in `sides`; `dealt`'s values are below `count`."""
    order = np.argsort(dealt, kind="stable")
    bounds = np.searchsorted(dealt[order], np.arange(count + 1))
    offsets = [np.cumsum(lens, dtype=np.int64) - lens for _, lens in sides]
    for k in range(count):
        rows = order[bounds[k]:bounds[k + 1]]
        if not len(rows):
            continue
        paths = paths_of(k)
        for (ids, lens), off, side in zip(sides, offsets, ("source", "target")):
            picked = lens[rows]
            within = np.arange(int(picked.sum())) - np.repeat(np.cumsum(picked, dtype=np.int64) - picked, picked)
            with open(paths[f"{side}_ids"], "ab") as f:
                ids[np.repeat(off[rows], picked) + within].tofile(f)
            with open(paths[f"{side}_lengths"], "ab") as f:
                picked.tofile(f)


def _deal(corpora, args, sp, target_sp, dtype, scatter: Path, rng: np.random.Generator) -> list[dict]:
    """Tokenizes every pair once (the source with `sp`, the target with `target_sp`: the same one but with a
    vocabulary per side) and appends it to a random shard's scatter files; returns each corpus's counts."""
    counted, t0, done = [], time.time(), 0
    threads = os.cpu_count() or 1
    for corpus in corpora:
        stats = ReadStats()
        name = " / ".join(corpus["files"]) if "files" in corpus else f"{corpus['tfds']} ({corpus.get('split', 'train')})"
        for src, tgt in iter_corpus_chunks(corpus, args.source_lang, args.target_lang,
                                           check_alignment=args.check_alignment, stats=stats):
            s_ids, s_len = _ids_array(sp.encode(src, num_threads=threads), dtype)
            t_ids, t_len = _ids_array(target_sp.encode(tgt, num_threads=threads), dtype)
            shard = rng.integers(0, args.shards, len(s_len))
            _append_dealt(lambda k: _scatter_paths(scatter, f"{k:05d}"), shard, args.shards,
                          ((s_ids, s_len), (t_ids, t_len)))
            done += len(s_len)
            if done % (50 * STREAM_CHUNK_LINES) < len(s_len):
                _log(f"tokenized {done:,} pairs ({done / (time.time() - t0):,.0f} pairs/s)")
        counted.append({"name": name, "lines": stats.lines, "pairs": stats.kept,
                        "empty_pairs_skipped": stats.empty_skipped})
    return counted


def _split_scatter(scatter: Path, name: str, pieces: int, dtype, rng: np.random.Generator) -> list[dict]:
    """Deals the pairs of scatter files `name` to `pieces` random scatter files (`name-J`), `PAIRS_PER_SHARD`
    pairs at a time, and deletes them; returns the pieces' paths."""
    paths = _scatter_paths(scatter, name)
    split = [_scatter_paths(scatter, f"{name}-{j:05d}") for j in range(pieces)]
    if paths["source_lengths"].exists():
        with (open(paths["source_ids"], "rb") as s_ids, open(paths["source_lengths"], "rb") as s_lens,
              open(paths["target_ids"], "rb") as t_ids, open(paths["target_lengths"], "rb") as t_lens):
            while True:
                s_len = np.fromfile(s_lens, np.int32, PAIRS_PER_SHARD)
                if not len(s_len):
                    break
                t_len = np.fromfile(t_lens, np.int32, len(s_len))
                sides = ((np.fromfile(s_ids, dtype, int(s_len.sum())), s_len),
                         (np.fromfile(t_ids, dtype, int(t_len.sum())), t_len))
                if len(t_len) != len(s_len) or any(len(ids) != lens.sum() for ids, lens in sides):
                    raise DataError(f"{paths['source_lengths'].parent}: the scatter files {name}.* end early; "
                                    f"run kt-prepare again")
                _append_dealt(split.__getitem__, rng.integers(0, pieces, len(s_len)), pieces, sides)
    for p in paths.values():
        p.unlink(missing_ok=True)
    return split


def _finish_shard(paths: dict, out: Path, k: int, count: int, dtype, rng: np.random.Generator):
    """Shuffles the pairs of the scatter files `paths` into shard k of `count` and writes its .npz (renamed into
    place whole); returns its manifest entry and its pairs' longer-side lengths."""
    arrays = {}
    for side in ("source", "target"):
        lengths = (np.fromfile(paths[f"{side}_lengths"], np.int32) if paths[f"{side}_lengths"].exists()
                   else np.zeros(0, np.int32))
        ids = np.fromfile(paths[f"{side}_ids"], dtype) if paths[f"{side}_ids"].exists() else np.zeros(0, dtype)
        arrays[side] = (ids, lengths)
    perm = rng.permutation(len(arrays["source"][1]))
    out_arrays = {}
    for side, (ids, lengths) in arrays.items():
        offsets = np.cumsum(lengths, dtype=np.int64) - lengths
        picked = lengths[perm]
        within = np.arange(int(picked.sum())) - np.repeat(np.cumsum(picked, dtype=np.int64) - picked, picked)
        out_arrays[f"{side}_ids"] = ids[np.repeat(offsets[perm], picked) + within]
        out_arrays[f"{side}_lengths"] = picked
    name = SHARD_PATTERN.format(index=k, count=count)
    tmp = out / (name + ".tmp.npz")
    np.savez(tmp, **out_arrays)
    fsync_file(tmp)  # on the disk before the manifest says it is (`prepare` syncs the directory's renames)
    os.replace(tmp, out / name)
    for p in paths.values():
        p.unlink(missing_ok=True)
    keys = np.maximum(out_arrays["source_lengths"], out_arrays["target_lengths"]) + 1
    entry = {"file": name, "pairs": len(perm), "source_tokens": int(out_arrays["source_lengths"].sum()),
             "target_tokens": int(out_arrays["target_lengths"].sum()), "bytes": (out / name).stat().st_size,
             "sha256": file_sha256(out / name),
             # Its shortest pair's longer side, with its start or end id: whether a length limit leaves it any.
             "shortest": int(keys.min()) if len(keys) else None}
    return entry, keys


def prepare(args) -> dict:
    """Prepares `args.out` as this module's docstring says; returns the manifest."""
    out = Path(args.out)
    corpora = [{"files": list(f)} for f in args.train_files or []]
    for name in args.tfds or []:
        name, _, split = name.partition(":")
        corpora.append({"tfds": name, "split": split or "train", "data_dir": args.data_dir,
                        "tfds_data_dir": args.tfds_data_dir})
    if not corpora:
        raise ConfigError("nothing to prepare: give --train-files SOURCE TARGET (repeatable) or --tfds NAME")
    if args.shards < 1:
        raise ConfigError(f"--shards must be 1 or more, got {args.shards}")
    if args.target_tokenizer and not args.tokenizer:
        raise ConfigError("--target-tokenizer needs --tokenizer: the sources' vocabulary, in the same ids")
    if args.source_lang == args.target_lang:
        raise ConfigError(f"--source-lang and --target-lang are both {args.source_lang!r}")
    request = {"corpora": [_corpus_request(c) for c in corpora], "source_lang": args.source_lang,
               "target_lang": args.target_lang, "shards": args.shards, "seed": args.seed,
               "check_alignment": args.check_alignment, "validation": _validation(args),
               "vocabulary": ({"tokenizer": str(Path(args.tokenizer).resolve()),
                               "sha256": file_sha256(args.tokenizer),
                               **({"target_tokenizer": str(Path(args.target_tokenizer).resolve()),
                                   "target_sha256": file_sha256(args.target_tokenizer)}
                                  if args.target_tokenizer else {})} if args.tokenizer else
                              {"vocab_size": args.vocab_size, "vocab_type": args.vocab_type,
                               "vocab_sample": args.vocab_sample,
                               "lowercase": args.lowercase})}
    manifest_path = out / MANIFEST_FILENAME
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
        if manifest.get("request") == request:
            _log(f"{out} is prepared already ({sum(s['pairs'] for s in manifest['shards']):,} pairs in "
                 f"{len(manifest['shards'])} shards): nothing to do")
            return manifest
        raise ConfigError(f"{out} holds a corpus prepared by another command (other corpora or options); "
                          f"prepare into a new --out, or delete {out}")
    out.mkdir(parents=True, exist_ok=True)
    # What a killed run left: shards without a manifest are not trusted; they are written again.
    shutil.rmtree(out / SCATTER_DIR, ignore_errors=True)
    for stale in out.glob("shard-*"):
        stale.unlink()
    t0 = time.time()
    proto = _vocabulary(args, out, corpora)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    vocab_size = sp.get_piece_size()
    target_sp = sp
    if args.target_tokenizer:
        target_sp = spm.SentencePieceProcessor(model_proto=_target_vocabulary(args, out, vocab_size))
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    scatter = out / SCATTER_DIR
    scatter.mkdir()
    rng = np.random.default_rng(args.seed)
    t1 = time.time()
    counted = _deal(corpora, args, sp, target_sp, dtype, scatter, rng)
    pairs = sum(c["pairs"] for c in counted)
    count = shard_count(pairs, args.shards)
    split = count // args.shards
    more = (f" (each of the {args.shards} dealt again to {split}: at most about {PAIRS_PER_SHARD:,} pairs a shard)"
            if split > 1 else "")
    _log(f"tokenized {pairs:,} pairs in {time.time() - t1:.0f} s; shuffling them into {count} shards{more}")
    shards, longest = [], []
    for k in range(args.shards):
        name = f"{k:05d}"
        pieces = _split_scatter(scatter, name, split, dtype, rng) if split > 1 else [_scatter_paths(scatter, name)]
        for j, paths in enumerate(pieces):
            entry, keys = _finish_shard(paths, out, k * split + j, count, dtype, rng)
            shards.append(entry)
            longest.append(np.bincount(keys) if len(keys) else np.zeros(1, np.int64))
    histogram = np.zeros(max(len(h) for h in longest), np.int64)
    for h in longest:
        histogram[: len(h)] += h
    shutil.rmtree(scatter, ignore_errors=True)
    # The shards' and the vocabulary's names in the directory on the disk before the manifest names them: a
    # power cut leaves no manifest, or one whose files are all there.
    fsync_directory(out)
    manifest = {
        "format": FORMAT,
        "request": request,
        "corpora": counted,
        "source_lang": args.source_lang,
        "target_lang": args.target_lang,
        "validation": request["validation"],
        "vocabulary": {"file": VOCABULARY_FILENAME, "pieces": vocab_size, "lowercase": lowercases(proto),
                       "sha256": file_sha256(out / VOCABULARY_FILENAME), "ids": str(np.dtype(dtype)),
                       **({"target_file": TARGET_VOCABULARY_FILENAME,
                           "target_sha256": file_sha256(out / TARGET_VOCABULARY_FILENAME)}
                          if args.target_tokenizer else {})},
        "pairs": pairs,
        "source_tokens": sum(s["source_tokens"] for s in shards),
        "target_tokens": sum(s["target_tokens"] for s in shards),
        "shards": shards,
        "pairs_per_shard_limit": PAIRS_PER_SHARD,  # `shard_count`'s, when the corpus was prepared
        # [i]: the pairs whose longer side, with its start or end id, is i tokens (kt-train's epoch length).
        "length_histogram": histogram.tolist(),
        "seconds": round(time.time() - t0, 1),
    }
    write_json_atomically(manifest_path, manifest)
    _log(f"{out}: {pairs:,} pairs ({manifest['source_tokens']:,} + {manifest['target_tokens']:,} tokens) in "
         f"{count} shards, written in {time.time() - t0:.0f} s")
    return manifest


def _validation(args) -> dict | None:
    """The validation set kt-train uses unless told another: --valid-files, else a TFDS corpus's own split."""
    if args.valid_files:
        return {"files": [str(Path(p).resolve()) for p in args.valid_files]}
    if args.tfds:
        name = args.tfds[0].partition(":")[0]
        return {"tfds": name, "split": "validation", "data_dir": args.data_dir, "tfds_data_dir": args.tfds_data_dir}
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kt-prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the directory to prepare (kt-train --prepared DIR reads it)")
    p.add_argument("--config", help="a kt-train JSON config: its vocab_size, vocab_type, vocab_sample, lowercase and seed are "
                   "this command's defaults (the flags below override them)")
    p.add_argument("--train-files", nargs=2, action="append", metavar=("SOURCE", "TARGET"),
                   help="a parallel corpus: two line-aligned text files, plain or gzip (repeatable)")
    p.add_argument("--tfds", action="append", metavar="NAME[:SPLIT]",
                   help="a TFDS translation dataset, e.g. wmt14_translate/de-en (split train by default), or "
                   "multi30k (repeatable)")
    p.add_argument("--valid-files", nargs=2, metavar=("SOURCE", "TARGET"),
                   help="kt-train's validation set (default: the first --tfds corpus's validation split)")
    p.add_argument("--source-lang", default="en")
    p.add_argument("--target-lang", default="de")
    p.add_argument("--data-dir", help="raw Multi30k directory, for --tfds multi30k")
    p.add_argument("--tfds-data-dir", help="where TFDS stores prepared datasets")
    p.add_argument("--tokenizer", help="an existing sentencepiece .model instead of training one")
    p.add_argument("--target-tokenizer", metavar="FILE",
                   help="a vocabulary per side: the targets' sentencepiece .model, in the ids of --tokenizer's (which "
                        "then reads the sources), as an imported Marian run's target_tokenizer.model")
    # The vocabulary's settings are kt-train's (training.config.TrainSettings): the same flags, help and defaults.
    add_setting_flags(p, ("vocab_size", "vocab_type", "vocab_sample", "lowercase"), with_defaults=True)
    p.add_argument("--shards", type=int, default=DEFAULT_SHARDS,
                   help=f"token-id shards to write, at least (default {DEFAULT_SHARDS}): a corpus of more than "
                   f"SHARDS x {PAIRS_PER_SHARD:,} pairs is written in the least multiple of SHARDS whose shards "
                   f"hold at most about {PAIRS_PER_SHARD:,} pairs each, so that preparing and training take the "
                   "same memory at any size; at least the number of workers that will train on them, several "
                   "each, a multiple of it to give each worker its own shards only")
    p.add_argument("--no-alignment-check", dest="check_alignment", action="store_false",
                   help="prepare --train-files even where their pairs look shifted by a line")
    p.add_argument("--seed", type=int, default=default("seed"),
                   help=f"seeds the vocabulary's sample and the shuffle (default: {default('seed')})")
    return p


# kt-train settings (training.config.TrainSettings' fields) that are kt-prepare's too.
CONFIG_KEYS = ("vocab_size", "vocab_type", "vocab_sample", "lowercase", "seed")


def parse_args(argv=None):
    """kt-prepare's arguments: the flags, over --config's settings, over the defaults."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.config:
        try:
            recipe = json.loads(Path(args.config).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--config {args.config}: {e}") from None
        parser.set_defaults(**{k: recipe[k] for k in CONFIG_KEYS if recipe.get(k) is not None})
        args = parser.parse_args(argv)
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args = parse_args(argv)
        prepare(args)
    except (DataError, ConfigError, FileNotFoundError) as e:
        print(f"kt-prepare: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
