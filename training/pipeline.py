"""tf.data input pipeline: tokenize (`common.tokenizer.encode_pair`), cap
lengths, batch by length buckets under a tokens-per-batch budget, shuffle, prefetch.

Batches are `((source, target_in), target_out)` int32, right-padded with 0.
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.text import PAD_ID
from common.tokenizer import encode_pair
from training.config import default
from training.errors import ConfigError


def bucket_boundaries(max_sentence_length: int, min_boundary: int = 8, growth: float = 1.2) -> list[int]:
    """Exclusive upper bounds of the length buckets (last bucket ends at max_sentence_length)."""
    bounds, b = [], min_boundary
    while b <= max_sentence_length:
        bounds.append(b)
        b = max(b + 4, int(round(b * growth / 4.0)) * 4)
    return bounds


def bucket_batch_sizes(boundaries, max_sentence_length: int, tokens_per_batch: int,
                       num_replicas: int = 1) -> list[int]:
    """Batch size per bucket so that batch_size * longest_in_bucket <= tokens_per_batch,
    rounded down to a multiple of num_replicas (each replica gets the same count)."""
    longest = [b - 1 for b in boundaries] + [max_sentence_length]
    if tokens_per_batch < max_sentence_length * num_replicas:
        raise ConfigError(
            f"tokens_per_batch={tokens_per_batch} is smaller than max_sentence_length*replicas="
            f"{max_sentence_length}*{num_replicas}; raise --tokens-per-batch or lower --max-sentence-length.")
    return [max(num_replicas, (tokens_per_batch // n) // num_replicas * num_replicas) for n in longest]


def make_batches(pairs, tokenizer, *, max_sentence_length: int = default("max_sentence_length"),
                 tokens_per_batch: int = default("tokens_per_batch"), num_replicas: int = 1,
                 shuffle: bool = True, shuffle_buffer: int = default("shuffle_buffer"),
                 seed: int | None = default("seed"),
                 repeat: bool = False, pad_to_bucket_boundary: bool = False, copies: int = 1):
    """Turns a dataset of `(source_text, target_text)` into padded, length-bucketed batches.

    Pairs whose source or target_in would be longer than `max_sentence_length` are dropped.
    The budget holds for padded tokens on each side: batch * padded_len <= tokens_per_batch.
    Yields `((source, target_in), target_out)`, as `model.fit` takes them.
    `pad_to_bucket_boundary` pads every batch to its bucket's longest length, so
    only a few distinct shapes occur (for XLA, which compiles once per shape).
    `copies` 2 puts every pair twice in a row in its batch (rows 2i and 2i + 1), as
    `keras_transformer.MaskedRDropCrossentropy` (R-Drop) needs: the budget then
    counts each pair once, and with `num_replicas` every replica's share of a
    batch holds whole pairs.
    """
    if copies < 1:
        raise ValueError(f"copies must be 1 or more, got {copies}")
    ds = pairs
    if shuffle:
        ds = ds.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.map(lambda source, target: encode_pair(tokenizer, source, target), num_parallel_calls=tf.data.AUTOTUNE)
    ds = ds.filter(lambda s, ti, to: tf.logical_and(tf.shape(s)[0] <= max_sentence_length,
                                                    tf.shape(ti)[0] <= max_sentence_length))
    bounds = bucket_boundaries(max_sentence_length)
    sizes = bucket_batch_sizes(bounds, max_sentence_length, tokens_per_batch, num_replicas)
    if pad_to_bucket_boundary:
        # Padding to boundary - 1 needs every length below the last boundary, and lengths reach
        # max_sentence_length, which no boundary exceeds (there is none at all below 8).
        bounds, sizes = bounds + [max_sentence_length + 1], sizes + [sizes[-1]]
    ds = ds.bucket_by_sequence_length(
        element_length_func=lambda s, ti, to: tf.maximum(tf.shape(s)[0], tf.shape(ti)[0]),
        bucket_boundaries=bounds,
        bucket_batch_sizes=sizes,
        padded_shapes=([None], [None], [None]),
        padding_values=(PAD_ID, PAD_ID, PAD_ID),
        pad_to_bucket_boundary=pad_to_bucket_boundary,
    )
    if num_replicas > 1:
        # A bucket's leftover batch may not split evenly over the replicas: trim it
        # to a multiple of num_replicas (drops at most num_replicas - 1 pairs per
        # bucket and epoch, different ones each epoch when shuffled).
        def trim(s, ti, to):
            n = tf.shape(s)[0] // num_replicas * num_replicas
            return s[:n], ti[:n], to[:n]

        ds = ds.map(trim).filter(lambda s, ti, to: tf.shape(s)[0] > 0)
    if copies > 1:
        # After the trim: a batch of n * num_replicas pairs, repeated, splits into num_replicas
        # contiguous shares of copies * n rows each, so no pair straddles two replicas.
        ds = ds.map(lambda s, ti, to: tuple(tf.repeat(t, copies, axis=0) for t in (s, ti, to)))
    if shuffle:
        ds = ds.shuffle(64, seed=seed, reshuffle_each_iteration=True)
    if repeat:
        ds = ds.repeat()
    ds = ds.map(lambda s, ti, to: ((s, ti), to))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    # No autotuning thread: deleting an iterator (Keras does, every epoch and every
    # validation) waits for that thread's next wake-up, up to a minute once the
    # iterator is old; that left some Multi30k epochs idle for up to as long as
    # their work took (docs/design.md, "No tf.data autotuning").
    # The map and prefetch still run in parallel.
    options.autotune.enabled = False
    return ds.with_options(options).prefetch(tf.data.AUTOTUNE)


def mean_target_tokens(batches, num_batches: int = 100) -> dict:
    """What a batch of `make_batches` holds on average over its first `num_batches` batches.

    Returns {"target_tokens": non-padding target tokens, "padded_target_tokens":
    batch * padded length on the target side, "sentences": pairs, "batches":
    batches counted}, each a mean per batch. `tokens_per_batch` bounds padded
    tokens; this is what a batch really trains on (fairseq's `--max-tokens`
    counts real tokens, so a recipe carried over from it is compared here).
    """
    def count(inputs, target_out):
        return tf.stack([tf.reduce_sum(tf.cast(target_out != PAD_ID, tf.int64)),
                         tf.cast(tf.size(target_out), tf.int64), tf.cast(tf.shape(target_out)[0], tf.int64),
                         tf.constant(1, tf.int64)])

    totals = batches.take(num_batches).map(count).reduce(tf.zeros([4], tf.int64), lambda a, b: a + b).numpy()
    n = max(int(totals[3]), 1)
    return {"target_tokens": totals[0] / n, "padded_target_tokens": totals[1] / n, "sentences": totals[2] / n,
            "batches": int(totals[3])}
