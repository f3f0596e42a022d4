"""Every use of private Keras API in the project, written for Keras 3.15 (setup.py pins keras>=3.15,<3.16).

On a Keras upgrade, run tests/test_keras_internals.py first: it has one test per use below, each checking
the Keras behaviour that the use relies on (not only that our code still runs), so a failure names the use to
rework. No other module of keras_transformer/, training/ or export/ reads a private Keras attribute, overrides
a private Keras method or imports `keras.src` (tests/test_layout.py checks it).

Two groups:

- The attention layer (the library, on every backend). Keras keeps `MultiHeadAttention`'s four projections,
  its options, its dropout layer and its mask rules in private attributes and methods, and computes the
  attention of the projected heads in a private method. The library's `MultiHeadAttention`
  (keras_transformer/attention.py) computes with those weights (`keras_transformer.linear`) through its public
  `projections` and `is_plain()`, which read them here, and implements `MultiHeadAttentionWithHook`'s public
  hook in place of the private method.
- kt-train's `fit()` (the TensorFlow backend, used by training/fit.py, keras_transformer/distributed.py and
  training/callbacks.py): workarounds for Keras 3.15's trainer, its optimizer's all-reduce and its backup
  callback. This module never imports TensorFlow at module level (`import keras_transformer` must not load it
  on JAX or PyTorch): what needs it imports it inside the function.

Covered further by tests/test_training_updates.py (the summed gradients, the loss tracker, the builds under
MirroredStrategy and MultiWorkerMirroredStrategy), tests/test_training_config.py (an epoch of unknown length),
tests/test_backup_faults.py and tests/test_training_distributed.py (the backups), tests/test_backends.py and
tests/portable/test_attention.py (the attention layer on every backend).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import warnings
from pathlib import Path
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
# kt-train's fit() (the TensorFlow backend). TensorFlow is imported inside the functions that need it.


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


# What Keras 3.15's EpochIterator warns when a dataset of unknown length (bucketed batches) runs out.
RAN_OUT_OF_DATA = "Your input ran out of data"


@contextlib.contextmanager
def ignoring_ran_out_of_data():
    """Silences `RAN_OUT_OF_DATA` inside the block (Keras 3.15: the private
    `EpochIterator.catch_stop_iteration`, which warns through `_interrupted_warning`).

    Bucketed batches have no length known in advance, so fit() and evaluate()
    learn an epoch's length by running out of data once, and Keras warns as if
    that were a mistake. Other warnings pass.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=RAN_OUT_OF_DATA)
        yield


class BackupAndRestoreState(keras.callbacks.BackupAndRestore):
    """`keras.callbacks.BackupAndRestore` with its private state (Keras 3.15) under public names.

    Keras 3.15 keeps the backup's paths in `_weights_path`, `_training_metadata_path`, `_prev_weights_path`
    and `_prev_training_metadata_path`, the metadata its `_save_model` writes in `_current_epoch` and
    `_last_batch_seen`, and writes every backup through `_save_model` (from `on_epoch_end`, and from
    `on_train_batch_end` when `save_freq` is a number). `save_backup()` replaces that private `_save_model()`;
    subclasses override `save_backup` and read the paths and counters below. `load_backup` restores as the
    private `_load_model` does, which sets the private `model._initial_epoch` that fit() starts at.
    """

    @property
    def weights_path(self) -> Path:
        return Path(self._weights_path)

    @property
    def metadata_path(self) -> Path:
        return Path(self._training_metadata_path)

    @property
    def previous_paths(self) -> list[tuple[Path, Path]]:
        """(current, previous) pairs for the weights and the metadata, when `double_checkpoint` is on."""
        if not self.double_checkpoint:
            return []
        return [(self.weights_path, Path(self._prev_weights_path)),
                (self.metadata_path, Path(self._prev_training_metadata_path))]

    @property
    def current_epoch(self) -> int:
        return self._current_epoch

    @current_epoch.setter
    def current_epoch(self, epoch: int) -> None:
        # Keras 3.15 leaves this at 0 after a resume until the first epoch ends, so a second
        # crash during the resumed epoch would record (and restart at) epoch 0.
        self._current_epoch = epoch

    @property
    def last_batch_seen(self) -> int:
        return self._last_batch_seen

    @last_batch_seen.setter
    def last_batch_seen(self, batch: int) -> None:
        # Keras 3.15 sets it in `_should_save_on_batch`, which a subclass that decides itself when to save
        # (overriding `on_train_batch_end`) no longer calls; `on_epoch_end` resets it to 0.
        self._last_batch_seen = batch

    def _save_model(self):
        self.save_backup()

    def load_backup(self, weights_path, metadata_path) -> dict:
        """Restores the model (and optimizer) from one backup pair as Keras' `_load_model` does,
        and sets the epoch `fit` starts at; returns the metadata. Raises if either file is unreadable, or if
        the two are of different optimizer steps."""
        meta = json.loads(Path(metadata_path).read_text())
        epoch = int(meta["epoch"])
        if self.model.optimizer is not None and not self.model.optimizer.built:
            self.model.optimizer.build(self.model.trainable_variables)
        weights_path = Path(weights_path)
        if weights_path.name.endswith(".weights.h5"):
            self.model.load_weights(str(weights_path))
        else:  # the previous backup (".bkp"): Keras reads weights only from a file named *.weights.h5
            readable = weights_path.with_name("restore.weights.h5")
            shutil.copyfile(weights_path, readable)
            try:
                self.model.load_weights(str(readable))
            finally:
                readable.unlink()
        if "step" in meta:
            # A pair is written and rotated one file after the other, so a kill between the two leaves new weights
            # beside old metadata (or the reverse): refused, as an unreadable pair is, so the other pair is used.
            loaded = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
            if loaded != int(meta["step"]):
                raise ValueError(f"its weights are of optimizer step {loaded}, its metadata "
                                 f"({Path(metadata_path).name}) of step {meta['step']}: a pair cut in two")
        self.model._initial_epoch = epoch
        return meta

    def save_backup(self):
        super()._save_model()


class UpdateBoundProgbar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar for a run bounded by updates alone: "Epoch 2 (to update 8,060)", not "Epoch 2/1000000".

    fit() needs an epoch count, and such a run gives it a stand-in that is never
    reached (`training.fit.NO_EPOCH_LIMIT`). Keras 3.15's `ProgbarLogger`
    prints its "Epoch N/M" line only when its `epochs` attribute (set from fit's
    epochs in `set_params`; public-named, but internal state) is above 1, and
    reads that attribute for nothing else; this sets it to 1 and prints its own
    line. Passed to fit() among the callbacks, it takes the place of the progress
    bar Keras would add (`CallbackList` adds one only when none is given).
    """

    def __init__(self, max_updates: int):
        super().__init__()
        self.max_updates = max_updates

    def set_params(self, params):
        super().set_params(params)
        self.epochs = 1

    def on_epoch_begin(self, epoch, logs=None):
        super().on_epoch_begin(epoch, logs)
        if self.verbose:
            print(f"Epoch {epoch + 1} (to update {self.max_updates:,})", flush=True)


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
