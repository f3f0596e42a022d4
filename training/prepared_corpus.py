"""A prepared corpus (`kt-prepare`'s output) and the batches kt-train streams from it.

A prepared directory holds:

- `tokenizer.model`: the sentencepiece vocabulary the ids are in;
- `shard-NNNNN-of-MMMMM.npz`: token-id shards, each a uniform random sample of
  all the corpora's pairs (kt-prepare deals every pair to a random shard, then
  shuffles each shard), holding `source_ids`/`target_ids` (the pieces, no
  start or end id, concatenated; uint16 for vocabularies up to 65,536 pieces)
  and `source_lengths`/`target_lengths` (pieces per pair, int32);
- `manifest.json`, written last and atomically: the corpora read and their
  counts, each shard's pairs, tokens, bytes and SHA-256, the vocabulary, the
  options used, and a histogram of the pairs' lengths. Without it the
  directory is not a prepared corpus.

Batches are built as fairseq builds them, from an index of lengths, a pool of
pairs at a time, in numpy: no per-pair work in the input pipeline. Each epoch
a worker reads its own shards (`worker_shards`) in a new random order, pools
about `POOL_PAIRS` pairs at a time, groups them by length bucket (the buckets
and budgets of `training.pipeline`), cuts each bucket into batches of its
size, and yields the pool's batches in a random order. The stream never ends:
kt-train's epoch is the corpus's batch count from the manifest
(`steps_per_epoch`), the same on every worker.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tensorflow as tf

from keras_transformer.text import END_ID, PAD_ID, START_ID
from training.errors import DataError, DataNotFoundError
from training.pipeline import bucket_batch_sizes, bucket_boundaries

MANIFEST_FILENAME = "manifest.json"
VOCABULARY_FILENAME = "tokenizer.model"
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


def write_json_atomically(path: Path, data: dict) -> None:
    """Writes `path` whole or not at all (a temporary file renamed over it)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    def pairs(self) -> int:
        return sum(s["pairs"] for s in self.shards)

    def load_shard(self, index: int) -> dict:
        """Shard `index`'s arrays, after checking its counts, and the first time its SHA-256, against the
        manifest."""
        entry = self.shards[index]
        path = self.directory / entry["file"]
        digest = entry["sha256"] if index in self.verified else file_sha256(path) if path.is_file() else None
        self.verified.add(index)
        if digest != entry["sha256"]:
            self.verified.discard(index)
            raise DataError(f"{path} does not match {self.directory / MANIFEST_FILENAME} (its SHA-256 differs"
                            f"{'; the file is missing' if digest is None else ''}): the shard was changed or "
                            f"damaged after kt-prepare wrote it. Run kt-prepare again into a new directory.")
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

    Checks the manifest is there and complete and that every shard of `shards`
    (default: all; a worker checks its own, `worker_shards`, and needs no
    other) exists at the size it records; each shard's SHA-256 and counts are
    checked when it is read (`PreparedCorpus.load_shard`).
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
    for entry in (corpus.shards if shards is None else [corpus.shards[i] for i in shards]):
        shard = directory / entry["file"]
        size = shard.stat().st_size if shard.is_file() else None
        if size != entry["bytes"]:
            what = "is missing" if size is None else f"has {size:,} bytes, the manifest says {entry['bytes']:,}"
            raise DataError(f"{shard} {what}: the prepared corpus {directory} is incomplete or was changed. Run "
                            f"kt-prepare again into a new directory.")
    if not corpus.tokenizer_file.is_file():
        raise DataError(f"{corpus.tokenizer_file} is missing: the prepared corpus {directory} has lost its "
                        f"vocabulary. Run kt-prepare again.")
    return corpus


def worker_shards(num_shards: int, worker: int, num_workers: int) -> list[int]:
    """The shards worker `worker` of `num_workers` reads: every `num_workers`-th, from its own index."""
    if num_shards < num_workers:
        raise DataError(f"The prepared corpus has {num_shards} shard(s), fewer than the {num_workers} workers "
                        f"training on it: each worker reads its own. Run kt-prepare again with --shards "
                        f"{num_workers} or more.")
    return list(range(worker, num_shards, num_workers))


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
    """Several shards' arrays as one, with each pair's offset into the concatenated ids."""

    def __init__(self, shards: list[dict]):
        self.source_ids = np.concatenate([s["source_ids"] for s in shards])
        self.target_ids = np.concatenate([s["target_ids"] for s in shards])
        self.source_lengths = np.concatenate([s["source_lengths"] for s in shards]).astype(np.int64)
        self.target_lengths = np.concatenate([s["target_lengths"] for s in shards]).astype(np.int64)
        self.source_offsets = np.cumsum(self.source_lengths) - self.source_lengths
        self.target_offsets = np.cumsum(self.target_lengths) - self.target_lengths

    def __len__(self):
        return len(self.source_lengths)


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
    side, with its start or end id) left out."""
    bounds, sizes, _ = bucket_plan(max_sentence_length, tokens_per_replica)
    keys = np.maximum(pool.source_lengths, pool.target_lengths) + 1
    kept = np.flatnonzero(keys <= max_sentence_length)
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


def stream_batches(corpus: PreparedCorpus, shards: list[int], *, max_sentence_length: int,
                   tokens_per_replica: int, seed: int, start: int = 0, pad_to_bucket_boundary: bool = False,
                   copies: int = 1,
                   pool_pairs: int = POOL_PAIRS, epochs: int | None = None):
    """Yields `((source, target_in), target_out)` numpy batches from `shards`, epoch after epoch (or `epochs`),
    each epoch in a new order drawn from `seed` and `start` (kt-train's: the update a run resumes from, so
    that a resumed run does not see its first epochs' order again)."""
    _, _, widths = bucket_plan(max_sentence_length, tokens_per_replica, pad_to_bucket_boundary)
    epoch = 0
    while epochs is None or epoch < epochs:
        rng = np.random.default_rng([seed, start, epoch])
        order = [shards[i] for i in rng.permutation(len(shards))]
        while order:
            loaded, pairs = [], 0
            while order and pairs < pool_pairs:
                loaded.append(corpus.load_shard(order.pop(0)))
                pairs += len(loaded[-1]["source_lengths"])
            pool = _Pool(loaded)
            del loaded
            for bucket, rows in pool_batches(pool, rng, max_sentence_length=max_sentence_length,
                                             tokens_per_replica=tokens_per_replica):
                yield make_batch(pool, rows, widths[bucket] if widths else None, copies)
        epoch += 1


BATCH_SIGNATURE = ((tf.TensorSpec([None, None], tf.int32), tf.TensorSpec([None, None], tf.int32)),
                   tf.TensorSpec([None, None], tf.int32))


def prepared_dataset(corpus: PreparedCorpus, shards: list[int], **kwargs) -> tf.data.Dataset:
    """`stream_batches` as a `tf.data.Dataset` (prefetched: the batches are built while the model trains)."""
    ds = tf.data.Dataset.from_generator(lambda: stream_batches(corpus, shards, **kwargs),
                                        output_signature=BATCH_SIGNATURE)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.autotune.enabled = False  # as training.pipeline.make_batches: no autotuning thread
    return ds.with_options(options).prefetch(8)
