"""The library's uses of private Keras API, written for Keras 3.15 (setup.py pins keras>=3.15,<3.16).

On a Keras upgrade, run tests/test_keras_internals.py first: it has one test per use below, each checking
the Keras behaviour that the use relies on (not only that our code still runs), so a failure names the use to
rework. kt-train's own uses (its backups, progress bar, an epoch's end) are in training/keras_internals.py; no
other module of keras_transformer/, training/, export/, common/ or bench/ reads a private Keras attribute,
overrides a private Keras method or imports `keras.src` (tests/test_layout.py checks it).

Two groups:

- The attention layer (on every backend). Keras keeps `MultiHeadAttention`'s four projections,
  its options, its dropout layer and its mask rules in private attributes and methods, and computes the
  attention of the projected heads in a private method. The library's `MultiHeadAttention`
  (keras_transformer/attention.py) computes with those weights (`keras_transformer.linear`) through its public
  `projections` and `is_plain()`, which read them here, and implements `MultiHeadAttentionWithHook`'s public
  hook in place of the private method.
- The training step for tf.distribute, `kt.UpdateStep` (keras_transformer/distributed.py, which kt-train uses
  too; the TensorFlow backend): workarounds for Keras 3.15's trainer and its optimizer's all-reduce. This
  module never imports TensorFlow at module level (`import keras_transformer` must not load it on JAX or
  PyTorch): what needs it imports it inside the function.

Covered further by tests/test_training_updates.py (the summed gradients, the loss tracker, the builds under
MirroredStrategy and MultiWorkerMirroredStrategy), tests/test_training_config.py (an epoch of unknown length),
tests/test_backends.py and tests/portable/test_attention.py (the attention layer on every backend).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import keras

from keras_transformer.linear import is_plain

# ---------------------------------------------------------------------------------------------------------------
# The attention layer (any backend).


class AttentionProjections(NamedTuple):
    """The four `EinsumDense` projections of a `keras.layers.MultiHeadAttention`: W^Q, W^K, W^V (kernels
    `[dim, num_heads, head_dim]`) and W^O (kernel `[num_heads, head_dim, dim]`)."""

    query: Any
    key: Any
    value: Any
    output: Any


def attention_projections(layer) -> AttentionProjections:
    """`layer`'s projections (Keras 3.15: the private `_query_dense`, `_key_dense`, `_value_dense`,
    `_output_dense`): the layer's only weights, which Keras' `call` computes with; the library computes the same
    products with them as 2-D matmuls, so that a file saved by either layer loads into the other."""
    return AttentionProjections(layer._query_dense, layer._key_dense, layer._value_dense, layer._output_dense)


def attention_is_plain(layer) -> bool:
    """True when `layer` (built) computes the paper's attention: no gate or sliding window (Keras 3.15: the
    private `_use_gate` and `_sliding_window`, which Keras exposes under no public name; options newer than
    Keras 3.12, hence `getattr`), attention over the sequence axis only (the public `attention_axes`, which
    `build` sets to `(1,)` on `[batch, length, dim]` inputs), float (not quantized) kernels."""
    return (
        not getattr(layer, "_use_gate", False)
        and getattr(layer, "_sliding_window", None) is None
        and tuple(layer.attention_axes) == (1,)
        and all(is_plain(dense) for dense in attention_projections(layer))
    )


def attention_dropout_layer(layer):
    """The `Dropout` that `layer` applies to its attention weights (Keras 3.15: the private `_dropout_layer`,
    created in `_build_attention` with the layer's `dropout` rate and seed). The library drops its weights
    with that same layer, so dropout draws from the layer's own seed generator, as Keras' does."""
    return layer._dropout_layer


def attention_mask_of_call(layer, query, value, **masks):
    """The `[batch, query_len, key_len]` mask (or None) that Keras' `MultiHeadAttention.call` builds from
    `attention_mask`, `query_mask`, `value_mask`, `key_mask`, `use_causal_mask` and the inputs' Keras masks
    (Keras 3.15: the private `_compute_attention_mask(query, value, query_mask=..., value_mask=...,
    key_mask=..., attention_mask=..., use_causal_mask=...)`): the library's full pass applies Keras' own mask
    rules rather than a copy of them."""
    return layer._compute_attention_mask(query, value, **masks)


class MultiHeadAttentionWithHook(keras.layers.MultiHeadAttention):
    """`keras.layers.MultiHeadAttention` whose attention step on the projected heads is a public method,
    `attention_of_heads`, for a subclass to implement (keras_transformer/attention.py does).

    Keras 3.15's `MultiHeadAttention.call` builds the mask, projects query, key and value to heads
    `[batch, length, num_heads, head_dim]`, then calls its private
    `self._compute_attention(query, key, value, attention_mask, training, return_attention_scores)`
    and projects the output it returns with `_output_dense`. This class overrides that private method to
    call `attention_of_heads` with the same arguments. Overriding it also turns off Keras' causal fast path
    (`call` passes `attention_mask=None` and `use_causal_mask=True` only to a class that does not override
    `_compute_attention`), so the hook always receives the mask as a tensor. `keras_attention_of_heads` is
    Keras' own computation (the private method of the parent class), the default and the fallback.
    """

    def _compute_attention(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False, **kwargs
    ):
        return self.attention_of_heads(query, key, value, attention_mask, training, return_attention_scores, **kwargs)

    def attention_of_heads(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False, **kwargs
    ):
        """Attention on heads `[batch, length, num_heads, head_dim]` -> `(output [batch, query_len, num_heads,
        value_dim], weights [batch, num_heads, query_len, key_len])`; `attention_mask` `[batch or 1,
        query_len, key_len]` is True where attention is allowed. Default: Keras' own."""
        return self.keras_attention_of_heads(
            query, key, value, attention_mask, training, return_attention_scores, **kwargs
        )

    def keras_attention_of_heads(
        self, query, key, value, attention_mask=None, training=None, return_attention_scores=False, **kwargs
    ):
        """Keras' own attention on heads (Keras 3.15: `keras.layers.MultiHeadAttention._compute_attention`)."""
        return super()._compute_attention(
            query, key, value, attention_mask, training, return_attention_scores, **kwargs
        )


# ---------------------------------------------------------------------------------------------------------------
# The training step for tf.distribute (the TensorFlow backend). TensorFlow is imported inside the functions
# that need it.


def build_fit_state_now(model, data_batch) -> None:
    """Builds the compiled loss and metrics from `data_batch` and turns off fit()'s own pre-build.

    Keras 3.15, the private `Trainer._symbolic_build(data_batch=...)` and the TensorFlow trainer's
    `_maybe_symbolic_build`, which fit() and evaluate() call before their first step:
    under tf.distribute, it would build them from the first batch reduced with
    strategy.reduce("MEAN"), which turns int token ids into floats, and under
    MultiWorkerMirroredStrategy that all-reduce fails outright when workers'
    batches differ in shape (PerReplica conversion error). Building here, from an
    int batch, and skipping the pre-build avoids both (and saves a batch).
    """
    symbolic_build = getattr(model, "_symbolic_build", None)
    if symbolic_build is not None and hasattr(model, "_maybe_symbolic_build"):
        symbolic_build(data_batch=data_batch)
        model._maybe_symbolic_build = lambda *args, **kwargs: None


def rank1_step_logs(model) -> None:
    """Makes fit() work under MultiWorkerMirroredStrategy (Keras 3.15's TensorFlow trainer).

    fit() averages each step's logs across workers in the private
    `keras.src.backend.tensorflow.trainer.reduce_per_replica`, with
    `strategy.reduce("MEAN", v, axis=0)`, which fails on the scalar loss and
    metric values ("Invalid reduction dimension 0 for input with 0
    dimensions"). Returning them with shape [1] from the step makes that
    reduction the mean over workers, a scalar again.
    """
    import tensorflow as tf

    def rank1(step):
        def wrapped(data):
            return {k: tf.reshape(v, [1]) for k, v in step(data).items()}

        wrapped.__wrapped__ = step  # inspect.unwrap(model.train_step) finds the step
        return wrapped

    model.train_step = rank1(model.train_step)
    model.test_step = rank1(model.test_step)


def no_step_without_data(model) -> None:
    """Makes every op of a training step wait for its batch (Keras 3.15's TensorFlow trainer).

    On a dataset of unknown length (bucketed batches), fit() learns that an epoch
    has ended when a step's `iterator.get_next()` raises OutOfRangeError, in the
    same graph as the step (the trainer's private `multi_step_on_iterator`). The
    step's ops that do not read the batch run before that error ends it: the
    optimizer's `_iterations.assign_add(1)` (`BaseOptimizer.apply`), and with
    gradient accumulation the accumulators' reset where the counter says an update
    is due. So every epoch's end counted an optimizer step that made no update,
    which moved the learning-rate schedule and `--max-updates` off the batches,
    and with accumulation summed gradients were lost. Traced under a control
    dependency on the batch's tensors, no op of the step runs without a batch.
    With a dataset of known length (`--steps-per-epoch`), and on JAX and PyTorch,
    there is no such step. Keras' main branch (commit 8a90a7d, for 3.16) asks for
    the batch before it runs the step, so on a later Keras this can go (its test
    says when).
    """
    import tensorflow as tf

    step = model.train_step

    def wrapped(data):
        with tf.control_dependencies([t for t in tf.nest.flatten(data) if t is not None]):
            return step(data)

    wrapped.__wrapped__ = step  # inspect.unwrap(model.train_step) finds the step
    model.train_step = wrapped


def apply_summed_gradients(optimizer) -> None:
    """Makes `optimizer.apply` take gradients already summed over the replicas (Keras 3.15's TensorFlow optimizer).

    `TFOptimizer._backend_update_step` all-reduces the gradients it is given
    (the private `_all_reduce_sum_gradients`) before the update. `keras_transformer.distributed.UpdateStep`
    all-reduces them itself, once per update, so that it can check and clip
    the sum first; a second all-reduce would multiply them by the replicas.
    """
    optimizer._all_reduce_sum_gradients = lambda grads_and_vars: list(grads_and_vars)


def loss_tracker(model):
    """The `keras.metrics.Mean` behind fit()'s "loss" log (Keras 3.15: the private `Trainer._loss_tracker`,
    created by `compile` and the first of `model.metrics`), for a training step of one's own to update."""
    return model._loss_tracker
