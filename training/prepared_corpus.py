"""A prepared corpus (`kt-prepare`'s output) and the batches kt-train streams from it.

A prepared directory holds:

- `tokenizer.model`: the sentencepiece vocabulary the ids are in; with a vocabulary per side (kt-prepare
  --target-tokenizer), the sources', and `target_tokenizer.model` the targets' (the same ids);
- `shard-NNNNN-of-MMMMM.npz`: token-id shards, each a uniform random sample of
  all the corpora's pairs (kt-prepare deals every pair to a random shard, then
  shuffles each shard), of at most about 100,000 pairs each
  (`training.prepare.PAIRS_PER_SHARD`: a larger corpus gets more shards, so
  that a pool below holds at most that many more than `POOL_PAIRS` whatever
  the corpus's size; directories prepared before the bound, past 6.4M pairs in
  64 shards, have larger shards and still load), holding
  `source_ids`/`target_ids` (the pieces, no start or end id, concatenated;
  uint16 for vocabularies up to 65,536 pieces) and
  `source_lengths`/`target_lengths` (pieces per pair, int32);
- `manifest.json`, written last and atomically, once the shards and the
  vocabulary are on the disk (fsynced): the corpora read and their counts,
  each shard's pairs, tokens, bytes, SHA-256 and shortest pair, the
  vocabulary and its SHA-256, the options used, and a histogram of the
  pairs' lengths. Without it the directory is not a prepared corpus.

Batches are built as fairseq builds them, from an index of lengths, a pool of
pairs at a time, in numpy: no per-pair work in the input pipeline. Each epoch
a worker reads its own shards (`worker_shards`: as many as every other
worker, and an equal part of each shard left over when the shards do not
divide among the workers) in a new random order, pools
about `POOL_PAIRS` pairs at a time, groups them by length bucket (the buckets
and budgets of `training.pipeline`), cuts each bucket into batches of its
size, and yields the pool's batches in a random order. The stream never ends:
kt-train's epoch is the corpus's batch count from the manifest
(`steps_per_epoch`), the same on every worker. Each epoch's order is drawn from the seed and the epoch's
number alone, and a resumed run's stream skips the batches its restored updates trained on, so it goes on
with the batches of a run never interrupted. A pass over a worker's shards
that yields no batch (every pair over the length limit, or no pair at all)
is an error, not an endless reload.

Before its first update a worker checks what it will read
(`open_for_worker`): the manifest, the vocabulary's SHA-256, that some pair
fits the length limit, and its shards' sizes and SHA-256 digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import tensorflow as tf

from keras_transformer.text import END_ID, PAD_ID, START_ID
from training.errors import DataError, DataNotFoundError
from training.pipeline import bucket_batch_sizes, bucket_boundaries

MANIFEST_FILENAME = "manifest.json"
VOCABULARY_FILENAME = "tokenizer.model"
# A corpus prepared with a vocabulary per side (kt-prepare --target-tokenizer): the targets' sentencepiece model,
# in the same ids as tokenizer.model (then the sources').
TARGET_VOCABULARY_FILENAME = "target_tokenizer.model"
FORMAT = "keras-transformer prepared corpus 1"
SHARD_PATTERN = "shard-{index:05d}-of-{count:05d}.npz"
# Pairs a worker batches together: their lengths sorted into buckets, each bucket's last batch part-full.
POOL_PAIRS = 200_000
SHARD_ARRAYS = ("source_ids", "source_lengths", "target_ids", "target_lengths")


def file_sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_file(path) -> None:
    """Flushes `path`'s bytes to the disk (the kernel's cache alone would lose them in a power cut)."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_directory(path) -> None:
    """Flushes `path`'s entries (the files created or renamed in it) to the disk; nothing where a directory
    cannot be opened (Windows)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Writes `path` whole or not at all (a temporary file renamed over it), on the disk when it returns."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)


def write_json_atomically(path: Path, data: dict) -> None:
    """`data` as indented JSON, written by `write_bytes_atomically`."""
    write_bytes_atomically(path, (json.dumps(data, indent=1) + "\n").encode())


class ShardPart(NamedTuple):
    """What a worker reads of shard `shard`: its pairs `first`, `first + step`, ... (by default all)."""

    shard: int
    first: int = 0
    step: int = 1


@dataclass
class PreparedCorpus:
    """A prepared directory whose manifest is complete and whose shards are all there, at their sizes."""

    directory: Path
    manifest: dict
    verified: set = field(default_factory=set)  # shards whose SHA-256 this process checked

    @property
    def shards(self) -> list[dict]:
        return self.manifest["shards"]

    @property
    def tokenizer_file(self) -> Path:
        return self.directory / self.manifest["vocabulary"]["file"]

    @property
    def target_tokenizer_file(self) -> Path | None:
        """The targets' sentencepiece model of a corpus prepared with a vocabulary per side, else None."""
        name = self.manifest["vocabulary"].get("target_file")
        return None if name is None else self.directory / name

    @property
    def manifest_file(self) -> Path:
        return self.directory / MANIFEST_FILENAME

    @property
    def pairs(self) -> int:
        return sum(s["pairs"] for s in self.shards)

    def check_sizes(self, shards: list[int] | None = None, whose: str = "") -> None:
        """A `DataError` unless every shard of `shards` (default: all) is there at the size the manifest records;
        `whose` says in the message who reads it."""
        for index in range(len(self.shards)) if shards is None else shards:
            entry = self.shards[index]
            shard = self.directory / entry["file"]
            size = shard.stat().st_size if shard.is_file() else None
            if size != entry["bytes"]:
                what = "is missing" if size is None else f"has {size:,} bytes, the manifest says {entry['bytes']:,}"
                raise DataError(f"{shard} {what}{whose}: the prepared corpus {self.directory} is incomplete or was "
                                f"changed. Copy the shard again from the directory kt-prepare wrote, or run "
                                f"kt-prepare again into a new directory.")

    def check_sha256(self, index: int) -> None:
        """A `DataError` unless shard `index`'s SHA-256 is the one the manifest records (checked once a process)."""
        if index in self.verified:
            return
        self.check_sizes([index])  # there, at its size: a missing shard is named as such, not as a changed one
        entry = self.shards[index]
        path = self.directory / entry["file"]
        if file_sha256(path) != entry["sha256"]:
            raise DataError(f"{path} does not match {self.manifest_file}: its SHA-256 is not the one recorded "
                            f"there, so its bytes were changed after kt-prepare wrote it (a disk fault, an "
                            f"incomplete or failed copy). Copy it again from the directory kt-prepare wrote, or "
                            f"run kt-prepare again into a new directory.")
        self.verified.add(index)

    def verify(self, shards: list) -> int:
        """Checks the SHA-256 of each shard of `shards` (indices or `ShardPart`s) against the manifest, as
        `check_sha256`; returns the bytes read."""
        indices = sorted({s.shard if isinstance(s, ShardPart) else int(s) for s in shards})
        read = sum(self.shards[i]["bytes"] for i in indices if i not in self.verified)
        for i in indices:
            self.check_sha256(i)
        return read

    def load_shard(self, index: int) -> dict:
        """Shard `index`'s arrays, after checking its counts, and the first time its SHA-256, against the
        manifest."""
        self.check_sha256(index)
        entry = self.shards[index]
        path = self.directory / entry["file"]
        with np.load(path) as z:
            arrays = {k: z[k] for k in SHARD_ARRAYS}
        counts = (len(arrays["source_lengths"]), int(arrays["source_lengths"].sum()),
                  int(arrays["target_lengths"].sum()))
        if counts != (entry["pairs"], entry["source_tokens"], entry["target_tokens"]):
            raise DataError(f"{path} holds {counts[0]} pairs of {counts[1]} + {counts[2]} tokens; the manifest "
                            f"says {entry['pairs']} of {entry['source_tokens']} + {entry['target_tokens']}. Run "
                            f"kt-prepare again into a new directory.")
        return arrays


def open_prepared(directory, shards: list[int] | None = None) -> PreparedCorpus:
    """The prepared corpus in `directory`, or a `DataError` saying why it cannot be trained on.

    Checks the manifest is there and complete, that the vocabulary is the one
    it records (its SHA-256), and that every shard of `shards` (default: all;
    a worker checks its own, `worker_shards`, and needs no other) exists at
    the size it records; each shard's SHA-256 and counts are checked when it
    is read (`PreparedCorpus.load_shard`), or before, all at once
    (`PreparedCorpus.verify`, kt-train's `open_for_worker`).
    """
    directory = Path(directory)
    path = directory / MANIFEST_FILENAME
    if not directory.is_dir():
        raise DataNotFoundError(f"Prepared corpus not found: {directory} (make one with kt-prepare)")
    if not path.is_file():
        raise DataError(f"{directory} has no {MANIFEST_FILENAME}: it is not a prepared corpus, or kt-prepare did "
                        f"not finish (it writes the manifest last). Run the same kt-prepare command again.")
    try:
        manifest = json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not valid JSON ({e}); run kt-prepare again.") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not a manifest of this version's prepared corpora (format "
                        f"{manifest.get('format')!r}, expected {FORMAT!r}); run kt-prepare again.")
    corpus = PreparedCorpus(directory, manifest)
    corpus.check_sizes(shards)
    for file, key in ((corpus.tokenizer_file, "sha256"), (corpus.target_tokenizer_file, "target_sha256")):
        if file is None:
            continue
        if not file.is_file():
            raise DataError(f"{file} is missing: the prepared corpus {directory} has lost its vocabulary. Copy it "
                            f"again from the directory kt-prepare wrote, or run kt-prepare again.")
        recorded = manifest["vocabulary"].get(key)
        if recorded and file_sha256(file) != recorded:
            raise DataError(f"{file} is not the vocabulary {directory} was prepared with: its SHA-256 is not the one "
                            f"{path} records. The shards hold that vocabulary's token ids; trained with another, the "
                            f"model would learn the wrong pieces. Put back the {file.name} kt-prepare wrote (copy it "
                            f"again from the directory kt-prepare wrote), or prepare the corpus again (kt-prepare "
                            f"--tokenizer FILE to prepare it in this vocabulary).")
    return corpus


def worker_shards(num_shards: int, worker: int, num_workers: int) -> list[ShardPart]:
    """What worker `worker` of `num_workers` reads of `num_shards` shards: as many pairs as every other worker,
    each pair read by one worker.

    Of the first `num_shards - num_shards % num_workers` shards, every `num_workers`-th, whole, from its own
    index; of each shard left over (the last `num_shards % num_workers`, shared), every `num_workers`-th pair,
    from its own index. The shards are uniform random samples of one corpus, so equal numbers of shards (and of
    parts of shards) are equal numbers of pairs, but for the sampling's noise. A worker needs its own shards and
    the shared ones on its disk, and no other.
    """
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} of {num_workers}: the index must be from 0 to {num_workers - 1}")
    if num_shards < num_workers:
        raise DataError(f"The prepared corpus has {num_shards} shard(s), fewer than the {num_workers} workers "
                        f"training on it: each worker reads its own. Run kt-prepare again with --shards "
                        f"{num_workers} or more (a multiple of {num_workers}).")
    dealt = num_shards - num_shards % num_workers
    return ([ShardPart(i) for i in range(worker, dealt, num_workers)]
            + [ShardPart(i, worker, num_workers) for i in range(dealt, num_shards)])


def sharing_note(num_shards: int, num_workers: int) -> str | None:
    """What `worker_shards` does with shards that do not divide among the workers, in a sentence; None when
    they divide."""
    left = num_shards % num_workers
    if not left or num_shards < num_workers:
        return None
    dealt = num_shards - left
    shared = ", ".join(str(i) for i in range(dealt, num_shards))
    return (f"{num_shards} shards do not divide among {num_workers} workers: each worker reads "
            f"{dealt // num_workers} shard(s) of its own and one pair in {num_workers} of the {left} left over "
            f"(shard(s) {shared}), so that every worker reads as many pairs and every pair is trained on; every "
            f"worker needs the shard(s) left over on its disk. With kt-prepare --shards {dealt} or "
            f"{dealt + num_workers}, each would read only its own.")


def _names(corpus: PreparedCorpus, shards: list) -> str:
    """The files of `shards` (indices or `ShardPart`s) for a message: the first few, then how many more."""
    files = [corpus.shards[s.shard if isinstance(s, ShardPart) else s]["file"] for s in shards]
    shown = ", ".join(files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return f"{corpus.directory}/{{{shown}}}" if len(files) > 1 else f"{corpus.directory / files[0]}"


def check_usable(corpus: PreparedCorpus, shards: list, max_sentence_length: int) -> None:
    """A `DataError` when the manifest shows that `shards` (indices or `ShardPart`s) hold no pair a batch can
    take: none at all, or none of at most `max_sentence_length` tokens (the longer side, with its start or end
    id). The shards' shortest pairs tell; a manifest from before they were recorded has the whole corpus's
    histogram only, and `stream_batches` finds the rest."""
    entries = [corpus.shards[s.shard if isinstance(s, ShardPart) else s] for s in shards]
    what = _names(corpus, shards)
    if not any(e["pairs"] for e in entries):
        raise DataError(f"{what} hold(s) no pair: this worker would wait forever for a first batch. Prepare the "
                        f"corpus again with fewer --shards (or train on fewer workers), so that every worker's "
                        f"shards hold pairs.")
    recorded = [e.get("shortest") for e in entries if e["pairs"]]
    if all(r is not None for r in recorded):
        shortest = min(recorded)
    else:
        shortest = next((i for i, n in enumerate(corpus.manifest["length_histogram"]) if n), 0)
        what = f"the corpus {corpus.directory}"
    if shortest > max_sentence_length:
        raise DataError(f"No pair of {what} fits the length limit of {max_sentence_length} tokens "
                        f"(--max-sentence-length): the shortest is {shortest} tokens (its longer side, with its "
                        f"start or end id). Every batch would leave every pair out, and training would wait "
                        f"forever for a first batch. Raise --max-sentence-length to {shortest} or more, or "
                        f"prepare a corpus of shorter pairs.")


def open_for_worker(directory, worker: int, num_workers: int, *, max_sentence_length: int,
                    say: Callable[[str], None] = print) -> tuple[PreparedCorpus, list[ShardPart]]:
    """The prepared corpus in `directory` and what worker `worker` of `num_workers` reads of it
    (`worker_shards`), checked before training, the quick checks first: the manifest and the vocabulary's
    SHA-256 (`open_prepared`), the worker's shards' sizes, that some pair of them fits `max_sentence_length`
    (`check_usable`), then their SHA-256 digests, which `say` tells the time of (as it tells how shards that do not
    divide among the workers are read, `sharing_note`). A `DataError` names the file and what to do."""
    corpus = open_prepared(directory, shards=[])
    parts = worker_shards(len(corpus.shards), worker, num_workers)
    whose = (f" (worker {worker + 1} of {num_workers} reads it: a worker needs its own shards, any shared ones, "
             f"the manifest and the vocabulary on its disk)" if num_workers > 1 else "")
    corpus.check_sizes([p.shard for p in parts], whose)
    check_usable(corpus, parts, max_sentence_length)
    note = sharing_note(len(corpus.shards), num_workers)
    if note:
        say(note)
    t0 = time.time()
    read = corpus.verify(parts)
    say(f"checked the SHA-256 of {'its' if num_workers > 1 else 'the'} {len(parts)} shard(s) "
        f"({read / 1e6:,.1f} MB) against {corpus.manifest_file} in {time.time() - t0:.1f} s")
    return corpus, parts


def bucket_plan(max_sentence_length: int, tokens_per_replica: int, pad_to_bucket_boundary: bool = False):
    """(bucket boundaries, pairs per batch in each bucket, padded width of each bucket or None)."""
    bounds = bucket_boundaries(max_sentence_length)
    sizes = bucket_batch_sizes(bounds, max_sentence_length, tokens_per_replica, 1)
    widths = [b - 1 for b in bounds] + [max_sentence_length] if pad_to_bucket_boundary else None
    return np.asarray(bounds), np.asarray(sizes), widths


def steps_per_epoch(corpus: PreparedCorpus, *, max_sentence_length: int, tokens_per_replica: int,
                    replicas: int) -> int:
    """Updates' worth of batches (one per replica) in one pass over the corpus: the manifest's length histogram
    cut into each bucket's batches, over all replicas. The same on every worker."""
    bounds, sizes, _ = bucket_plan(max_sentence_length, tokens_per_replica)
    lengths = np.asarray(corpus.manifest["length_histogram"], np.int64)  # [i]: pairs whose longer side is i
    keys = np.arange(len(lengths))[: max_sentence_length + 1]
    counts = np.bincount(np.searchsorted(bounds, keys, side="right"), weights=lengths[: max_sentence_length + 1],
                         minlength=len(sizes))
    batches = int(np.ceil(counts / sizes).sum())
    return max(1, batches // replicas)


class _Pool:
    """Several shards' arrays as one, with each pair's offset into the concatenated ids, and which pairs are
    read (`read`: a mask, or None for all): a shared shard's are one in so many."""

    def __init__(self, shards: list[dict], parts: list[ShardPart] | None = None):
        self.source_ids = np.concatenate([s["source_ids"] for s in shards])
        self.target_ids = np.concatenate([s["target_ids"] for s in shards])
        self.source_lengths = np.concatenate([s["source_lengths"] for s in shards]).astype(np.int64)
        self.target_lengths = np.concatenate([s["target_lengths"] for s in shards]).astype(np.int64)
        self.source_offsets = np.cumsum(self.source_lengths) - self.source_lengths
        self.target_offsets = np.cumsum(self.target_lengths) - self.target_lengths
        self.read = None
        if parts is not None and any(p.step > 1 for p in parts):
            self.read = np.concatenate([np.arange(len(s["source_lengths"])) % p.step == p.first
                                        for s, p in zip(shards, parts)])

    def __len__(self):
        return len(self.source_lengths)

    def keys(self) -> np.ndarray:
        """Each read pair's longer side, with its start or end id (what the length limit and buckets go by)."""
        keys = np.maximum(self.source_lengths, self.target_lengths) + 1
        return keys if self.read is None else keys[self.read]


def _scatter(ids, offsets, lengths, rows, width: int, first_column: int) -> np.ndarray:
    """`[len(rows), width]` int32: row r holds the ids of pair `rows[r]` from `first_column` on, then zeros."""
    lens = lengths[rows]
    out = np.full((len(rows), width), PAD_ID, np.int32)
    before = np.cumsum(lens) - lens
    within = np.arange(int(lens.sum())) - np.repeat(before, lens)
    out[np.repeat(np.arange(len(rows)), lens), within + first_column] = ids[np.repeat(offsets[rows], lens) + within]
    return out


def make_batch(pool: _Pool, rows: np.ndarray, width: int | None = None, copies: int = 1):
    """The pairs `rows` of `pool` as `((source, target_in), target_out)`, int32 `[batch, len]` each, each padded
    to its longest row (or to `width`): source = pieces + [END], target_in = [START] + pieces,
    target_out = pieces + [END], as `common.tokenizer.encode_pair` gives them."""
    s_len, t_len = pool.source_lengths[rows], pool.target_lengths[rows]
    n = np.arange(len(rows))
    s_width = width or int(s_len.max()) + 1
    t_width = width or int(t_len.max()) + 1
    source = _scatter(pool.source_ids, pool.source_offsets, pool.source_lengths, rows, s_width, 0)
    source[n, s_len] = END_ID
    target_out = _scatter(pool.target_ids, pool.target_offsets, pool.target_lengths, rows, t_width, 0)
    target_out[n, t_len] = END_ID
    target_in = _scatter(pool.target_ids, pool.target_offsets, pool.target_lengths, rows, t_width, 1)
    target_in[:, 0] = START_ID
    if copies > 1:
        source, target_in, target_out = (np.repeat(a, copies, axis=0) for a in (source, target_in, target_out))
    return (source, target_in), target_out


def pool_batches(pool: _Pool, rng: np.random.Generator, *, max_sentence_length: int, tokens_per_replica: int):
    """The row indices of each batch of `pool`, in a random order; pairs longer than `max_sentence_length` (either
    side, with its start or end id), and those it does not read (`_Pool.read`), left out."""
    bounds, sizes, _ = bucket_plan(max_sentence_length, tokens_per_replica)
    keys = np.maximum(pool.source_lengths, pool.target_lengths) + 1
    fits = keys <= max_sentence_length
    kept = np.flatnonzero(fits if pool.read is None else fits & pool.read)
    kept = kept[rng.permutation(len(kept))]
    bucket = np.searchsorted(bounds, keys[kept], side="right")
    order = np.argsort(bucket, kind="stable")  # random within each bucket
    kept, bucket = kept[order], bucket[order]
    starts = np.searchsorted(bucket, np.arange(len(sizes)), side="left")
    ends = np.searchsorted(bucket, np.arange(len(sizes)), side="right")
    batches = []
    for b in range(len(sizes)):
        for i in range(starts[b], ends[b], sizes[b]):
            batches.append((b, kept[i: min(i + sizes[b], ends[b])]))
    return [batches[i] for i in rng.permutation(len(batches))]


def _pools(corpus: PreparedCorpus, order: list[ShardPart], pool_pairs: int) -> list[list[ShardPart]]:
    """`order`'s parts, in that order, cut into pools of about `pool_pairs` pairs (each pool closed once it
    holds `pool_pairs` or more; the last may hold fewer). The manifest's counts tell: no shard is read."""
    pools, pool, pairs = [], [], 0
    for part in order:
        pool.append(part)
        pairs += len(range(part.first, corpus.shards[part.shard]["pairs"], part.step))
        if pairs >= pool_pairs:
            pools.append(pool)
            pool, pairs = [], 0
    return pools + [pool] if pool else pools


def _bucket_counts(corpus: PreparedCorpus, part: ShardPart, max_sentence_length: int,
                   tokens_per_replica: int) -> np.ndarray:
    """The pairs of `part` a batch takes (read by this part, within `max_sentence_length`), per length bucket
    (`bucket_plan`'s): what `pool_batches` makes of them, from the shard's lengths alone."""
    bounds, sizes, _ = bucket_plan(max_sentence_length, tokens_per_replica)
    corpus.check_sha256(part.shard)
    with np.load(corpus.directory / corpus.shards[part.shard]["file"]) as z:
        keys = np.maximum(z["source_lengths"], z["target_lengths"]).astype(np.int64)[part.first::part.step] + 1
    keys = keys[keys <= max_sentence_length]
    return np.bincount(np.searchsorted(bounds, keys, side="right"), minlength=len(sizes))


def stream_batches(corpus: PreparedCorpus, shards: list, *, max_sentence_length: int,
                   tokens_per_replica: int, seed: int, skip: int = 0, pad_to_bucket_boundary: bool = False,
                   copies: int = 1,
                   pool_pairs: int = POOL_PAIRS, epochs: int | None = None):
    """Yields `((source, target_in), target_out)` numpy batches from `shards` (shard indices, read whole, or
    `ShardPart`s, `worker_shards`'), epoch after epoch (or `epochs`), each epoch in a new order drawn from
    `seed` and the epoch's number alone. `skip`: batches not yielded at the stream's start (kt-train's: those
    the updates a run resumes from trained on), so that a resumed run goes on with the very batches an
    uninterrupted one would; whole pools of them are passed over without reading their pairs (each shard's
    lengths tell how many batches a pool makes). A pass over `shards` that yields no batch raises a
    `DataError` naming them and the length limit: the stream would otherwise read them again and again,
    forever, without a batch."""
    parts = [s if isinstance(s, ShardPart) else ShardPart(int(s)) for s in shards]
    if not parts:
        raise DataError("no shards to stream batches from")
    if skip < 0:
        raise ValueError(f"skip must be >= 0, got {skip}")
    _, sizes, widths = bucket_plan(max_sentence_length, tokens_per_replica, pad_to_bucket_boundary)
    counts = {}  # each part's `_bucket_counts`, read once the stream skips
    epoch = 0
    while epochs is None or epoch < epochs:
        rng = np.random.default_rng([seed, epoch])
        order = [parts[i] for i in rng.permutation(len(parts))]
        batches, read, shortest = 0, 0, None
        for pooled in _pools(corpus, order, pool_pairs):
            if skip:
                for part in pooled:
                    if part not in counts:
                        counts[part] = _bucket_counts(corpus, part, max_sentence_length, tokens_per_replica)
                per_bucket = sum(counts[part] for part in pooled)
                planned = int(np.ceil(per_bucket / sizes).sum())
                if 0 < planned <= skip:
                    # The draws `pool_batches` makes (the pairs' order, the batches' order): what follows is
                    # drawn as in a stream that built these batches.
                    rng.permutation(int(per_bucket.sum()))
                    rng.permutation(planned)
                    skip -= planned
                    batches += planned
                    continue
            pool = _Pool([corpus.load_shard(part.shard) for part in pooled], pooled)
            keys = pool.keys()
            read += len(keys)
            if len(keys):
                shortest = int(keys.min()) if shortest is None else min(shortest, int(keys.min()))
            planned = pool_batches(pool, rng, max_sentence_length=max_sentence_length,
                                   tokens_per_replica=tokens_per_replica)
            batches += min(skip, len(planned))
            planned, skip = planned[skip:], max(0, skip - len(planned))
            for bucket, rows in planned:
                batches += 1
                yield make_batch(pool, rows, widths[bucket] if widths else None, copies)
        if not batches:
            held = (f"none of their {read:,} pairs fits the length limit of {max_sentence_length} tokens "
                    f"(--max-sentence-length; the shortest is {shortest} tokens, its longer side with its start or "
                    f"end id): raise the limit to {shortest} or more" if read else
                    "they hold no pair: prepare the corpus with fewer --shards, or train on fewer workers")
            raise DataError(f"A pass over {_names(corpus, parts)} gave no batch: {held}.")
        epoch += 1


BATCH_SIGNATURE = ((tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.int32)),
                   tf.TensorSpec([None, None], tf.int32))


def prepared_dataset(corpus: PreparedCorpus, shards: list, *, skip: int | Callable[[], int] = 0,
                     **kwargs) -> tf.data.Dataset:
    """`stream_batches` as a `tf.data.Dataset` (prefetched: the batches are built while the model trains).
    `skip`: `stream_batches`', or a function giving it, asked each time an iterator starts the stream (kt-train's
    gives the batches of the updates the run restored from its backup, which Keras restores after the dataset
    is made)."""

    def stream():
        return stream_batches(corpus, shards, skip=skip() if callable(skip) else skip, **kwargs)

    ds = tf.data.Dataset.from_generator(stream, output_signature=BATCH_SIGNATURE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.autotune.enabled = False  # as training.pipeline.make_batches: no autotuning thread
    return ds.with_options(options).prefetch(8)


def worker_dataset_fn(corpus: PreparedCorpus, shards: list, pipeline: tuple[int, int], **kwargs):
    """The dataset function (`strategy.distribute_datasets_from_function`'s) of the worker whose input pipeline
    is `pipeline` (id, count: `training.distribute.input_pipeline`), streaming `shards`, what `open_for_worker`
    checked for it, with `prepared_dataset`'s `kwargs`. A `RuntimeError` if TensorFlow numbers the pipeline
    otherwise: the worker would stream shards it did not check, or another worker's."""

    def dataset(context=tf.distribute.InputContext()):
        numbered = (context.input_pipeline_id, context.num_input_pipelines)
        if numbered != tuple(pipeline):
            raise RuntimeError(f"TensorFlow numbers this worker's input pipeline {numbered[0]} of {numbered[1]}, but "
                               f"its shards were picked and checked as pipeline {pipeline[0]} of {pipeline[1]} "
                               f"(from TF_CONFIG): is TF_CONFIG the one the strategy was made with?")
        return prepared_dataset(corpus, shards, **kwargs)

    return dataset
