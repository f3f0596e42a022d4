"""Concurrent requests share one decoding loop: TensorFlow's BatchFunction op inside the served graph.

A server's traffic is many clients, each sending a sentence or a few at the same time. Without batching each
request runs its own decoding loop, and at batch 1 a loop's step costs the executor's dispatch of its ops, not
arithmetic: 64 clients then get a fraction of what the same export decodes given batches of 64. With
`RequestBatching`, each decoding signature runs its work through the core `BatchFunction` op (what
`tf.nondifferentiable_batch_function` emits): calls that arrive while a batch is being decoded wait in a
queue, and when the batch thread is free it takes them all (up to `max_batch_size` sentences) as one batch,
decodes it, and hands each call its own rows. The op is a core kernel, so it runs wherever the SavedModel
loads: `tensorflow_model_server` without flags, TF Serving's C++ loader, `tf.saved_model.load`.

Merging requests is safe because the export's default float32 decoding gives a sentence the same translation
and score alone or in any batch (export/README.md); `truncated`, the empty-input rule and every per-row
option (seed, temperature, top_k, prefix, target) are per row. Outputs whose width is the batch's (the `align`
signature's `[batch, length]` rows, `translate_ids`' tokens) are trimmed back to the request's own rows, so
their shapes do not depend on the batch either.

The timeout (`timeout_micros`) is how long a batch waits for more calls before it runs. With the default 0 a
lone client waits for nothing: its request runs as soon as the batch thread is free, while requests that come
in during a decode queue up and form the next batch. A larger timeout makes fuller batches when clients
arrive spread out, at that much latency for every request that finds the thread idle. docs/serving.md, "Under
load", has the trade-off and the figures.
"""

from __future__ import annotations

import dataclasses
import uuid

import tensorflow as tf

from export.search import graph_function

# The defaults kt-export uses (docs/serving.md, "Under load"): at batch 64 the export decodes several times
# the sentences a second it does at batch 1, and a larger batch gains little more on a CPU.
DEFAULT_MAX_BATCH_SIZE = 64
DEFAULT_TIMEOUT_MICROS = 0
# Batches waiting for the batch thread, at most: beyond this many a request fails at once (UNAVAILABLE,
# "queue is full") rather than waiting without end.
DEFAULT_MAX_ENQUEUED_BATCHES = 1000


@dataclasses.dataclass(frozen=True)
class RequestBatching:
    """How a decoding signature merges concurrent calls (see the module docstring).

    Args:
        max_batch_size: most sentences in one merged batch. A call with more sentences than this is decoded
            whole, on its own, as without batching.
        timeout_micros: how long a batch that is not full waits for more calls before it runs (0: not at
            all; it runs when the batch thread is free).
        batch_threads: merged batches decoded at once. 1 (default): one batch at a time, which itself runs
            on every core (`kt-export --parallel-loops`); calls arriving meanwhile form the next batch.
        max_enqueued_batches: batches that may wait for a batch thread; a call beyond them fails at once
            with UNAVAILABLE.
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    timeout_micros: int = DEFAULT_TIMEOUT_MICROS
    batch_threads: int = 1
    max_enqueued_batches: int = DEFAULT_MAX_ENQUEUED_BATCHES

    def __post_init__(self):
        for name, least in (("max_batch_size", 1), ("timeout_micros", 0), ("batch_threads", 1),
                            ("max_enqueued_batches", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"RequestBatching.{name} must be an integer >= {least}, got {value!r}")

    def describe(self) -> str:
        return (f"concurrent requests merged into batches of up to {self.max_batch_size} sentences "
                f"(timeout {self.timeout_micros} us, {self.batch_threads} batch thread"
                f"{'s' if self.batch_threads != 1 else ''})")


def batched(fn, input_signature, batching: RequestBatching | None, name: str):
    """`fn` with its calls merged with concurrent ones by `batching` (None: `fn` itself).

    Args:
        fn: `(*tensors) -> dict of tensors`, every input and output batch-first (`[batch, ...]`), the inputs'
            other dimensions fixed (they are concatenated along the batch), and row i of each output a
            function of row i of the inputs alone.
        input_signature: `fn`'s `tf.TensorSpec`s, the batch dimension None.
        batching: a `RequestBatching`, or None.
        name: the batching queue's name (the signature's), made unique to this export by a random suffix.

    Returns:
        A function of the same tensors, to be called inside a `tf.function`: batches of 1 to
        `max_batch_size` rows go through the queue; an empty batch, or a larger one, runs `fn` directly.
    """
    if batching is None:
        return fn
    computation = graph_function(fn).get_concrete_function(*input_signature)
    shared_name = f"{name}_{uuid.uuid4().hex}"
    output_dtypes = [t.dtype for t in computation.outputs]

    def call(*tensors):
        rows = tf.shape(tensors[0])[0]

        def merged():
            # The op itself rather than `tf.nondifferentiable_batch_function`, which names every queue after the
            # calling name scope, "batch/" in every traced signature. The queue is a resource found by that
            # name, so two signatures of one SavedModel would share it, and a call could be answered by the
            # other signature's function (seen on TF 2.21: tests/test_request_batching.py).
            outputs = tf.raw_ops.BatchFunction(
                in_tensors=list(tensors), captured_tensors=computation.captured_inputs, f=computation,
                num_batch_threads=batching.batch_threads, max_batch_size=batching.max_batch_size,
                batch_timeout_micros=batching.timeout_micros, Tout=output_dtypes,
                max_enqueued_batches=batching.max_enqueued_batches, shared_name=shared_name,
                # Never split a call across batches: a call's rows come back from one batch, with one width.
                enable_large_batch_splitting=False)
            return tf.nest.pack_sequence_as(computation.structured_outputs, outputs, expand_composites=True)

        # The same concrete function on both branches: the SavedModel holds its graph once.
        result = tf.cond((rows > 0) & (rows <= batching.max_batch_size), merged, lambda: computation(*tensors))
        tf.nest.map_structure(lambda tensor, spec: tensor.set_shape(spec.shape), result,
                              computation.structured_outputs)
        return result

    call.concrete_function = computation
    return call


def used_width(values, padding):
    """How many leading columns of `values` `[batch, width]` some row uses: the width without the trailing
    columns that are `padding` in every row (0 for a batch of 0)."""
    used = tf.cast(tf.reduce_any(tf.not_equal(values, padding), axis=0), tf.int32)
    positions = tf.range(1, tf.shape(values)[1] + 1) * used
    return tf.reduce_max(tf.concat([[0], positions], axis=0))
