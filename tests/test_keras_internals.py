"""The Keras behaviour behind each use of private Keras API (keras_transformer/keras_internals.py, the library's, and
training/keras_internals.py, kt-train's), one test per use.

Each test checks Keras itself, as Keras 3.15 behaves, not only that our code runs: should one fail after a
Keras upgrade, the behaviour that the use named in the test relies on changed, and the use with it. The
attention tests use numpy and keras alone (they also run under KERAS_BACKEND=jax or torch); the trainer
tests are TensorFlow's (kt-train's fit()).
"""

import json
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest

from conftest import REPO, distributed_env
from keras_transformer import keras_internals
from keras_transformer.keras_internals import (
    MultiHeadAttentionWithHook,
    apply_summed_gradients,
    attention_dropout_layer,
    attention_is_plain,
    attention_mask_of_call,
    attention_projections,
    build_fit_state_now,
    loss_tracker,
    no_step_without_data,
    rank1_step_logs,
)
from training import keras_internals as training_keras_internals
from training.keras_internals import (RAN_OUT_OF_DATA, BackupAndRestoreState, EpochCut, UpdateBoundProgbar,
                                      ignoring_ran_out_of_data)

to_numpy = keras.ops.convert_to_numpy
tensorflow_only = pytest.mark.skipif(keras.backend.backend() != "tensorflow",
                                     reason="kt-train's fit() internals: the TensorFlow trainer")
B, T, S, D, HEADS, HEAD_DIM = 2, 3, 5, 8, 2, 4  # batch, query and key lengths, model dim, heads, head dim


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, D)).astype("float32"), rng.normal(size=(B, S, D)).astype("float32")


def _random_weights(layer, seed=1):
    """Non-zero biases too, so that a projection left out shows in the output."""
    rng = np.random.default_rng(seed)
    layer.set_weights([rng.normal(size=w.shape).astype("float32") for w in layer.get_weights()])


class RecordingAttention(keras.layers.MultiHeadAttention):
    """Keras' layer with its private `_compute_attention` overridden, recording each call's arguments."""

    def __init__(self, *args, answer=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls, self.answer = [], answer

    def _compute_attention(self, query, key, value, attention_mask=None, training=None, return_attention_scores=False,
                           **kwargs):
        self.calls.append(dict(heads=(query, key, value), mask=attention_mask, training=training,
                               return_attention_scores=return_attention_scores, kwargs=kwargs))
        output, scores = super()._compute_attention(query, key, value, attention_mask, training,
                                                    return_attention_scores, **kwargs)
        return (output if self.answer is None else self.answer(output)), scores


# ---------------------------------------------------------------------------------------------------------------
# The attention layer.


def test_keras_attention_computes_with_its_four_private_projections_alone():
    """`attention_projections` (`_query_dense`, `_key_dense`, `_value_dense`, `_output_dense`): they are the
    layer's only weights, with the kernel shapes the library's 2-D matmuls assume, and Keras' output is
    softmax(x W^Q (y W^K)^T / sqrt(d_k)) y W^V W^O computed from them alone."""
    x, y = _inputs()
    layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM)
    layer(x, y)
    _random_weights(layer)
    w = attention_projections(layer)
    assert all(isinstance(dense, keras.layers.EinsumDense) for dense in w)
    assert {id(v) for v in layer.weights} == {id(v) for dense in w for v in dense.weights}
    assert [tuple(dense.kernel.shape) for dense in w] == [(D, HEADS, HEAD_DIM)] * 3 + [(HEADS, HEAD_DIM, D)]

    def heads(inputs, dense):
        return np.einsum("btd,dnh->btnh", inputs, to_numpy(dense.kernel)) + to_numpy(dense.bias)

    q, k, v = heads(x, w.query) / np.sqrt(HEAD_DIM), heads(y, w.key), heads(y, w.value)
    scores = np.einsum("btnh,bsnh->bnts", q, k)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    output = np.einsum("bnts,bsnh->btnh", weights, v)
    expected = np.einsum("btnh,nhd->btd", output, to_numpy(w.output.kernel)) + to_numpy(w.output.bias)
    np.testing.assert_allclose(to_numpy(layer(x, y)), expected, rtol=1e-5, atol=1e-5)


def test_keras_attention_keeps_its_gate_and_sliding_window_in_private_attributes():
    """`attention_is_plain` (`_use_gate`, `_sliding_window`; the public `attention_axes`): the options are
    found there, and each makes the layer one the library leaves to Keras' code."""
    x, _ = _inputs()
    plain = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM)
    plain(x, x)
    assert (plain._use_gate, plain._sliding_window, plain.attention_axes) == (False, None, (1,))
    assert attention_is_plain(plain)

    gated = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM, use_gate=True)
    windowed = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM, sliding_window=2)
    gated(x, x), windowed(x, x)
    assert gated._use_gate is True and windowed._sliding_window == 2
    # The options change what Keras computes: the gate adds weights, the window masks far positions.
    assert len(gated.weights) > len(plain.weights)
    _, scores = windowed(x, x, return_attention_scores=True)
    assert np.all(to_numpy(scores)[:, :, 0, 2:] == 0)
    two_axes = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM, attention_axes=(1, 2))
    grid = np.zeros((B, 2, T, D), "float32")
    two_axes(grid, grid)
    assert tuple(two_axes.attention_axes) == (1, 2)
    assert not any(attention_is_plain(layer) for layer in (gated, windowed, two_axes))


def test_keras_attention_drops_its_weights_with_its_private_dropout_layer(monkeypatch):
    """`attention_dropout_layer` (`_dropout_layer`): a `Dropout` of the layer's rate and seed, which Keras
    applies to the attention weights `[batch, heads, query_len, key_len]` in training."""
    x, y = _inputs()
    layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM, dropout=0.5, seed=7)
    layer(x, y)
    dropout = attention_dropout_layer(layer)
    assert isinstance(dropout, keras.layers.Dropout) and (dropout.rate, dropout.seed) == (0.5, 7)
    seen, call = [], dropout.call

    def recording(inputs, training=False):
        seen.append((tuple(inputs.shape), training))
        return call(inputs, training=training)

    monkeypatch.setattr(dropout, "call", recording)
    layer(x, y, training=True)
    assert seen == [((B, HEADS, T, S), True)]


def test_keras_attention_builds_the_mask_of_a_call_in_its_private_compute_attention_mask():
    """`attention_mask_of_call` (`_compute_attention_mask`): it takes these keyword arguments, ANDs the masks
    into `[batch, query_len, key_len]`, and that is the mask Keras' `call` attends with."""
    x, y = _inputs()
    rng = np.random.default_rng(2)
    value_mask = rng.random((B, S)) < 0.7
    attention_mask = rng.random((B, T, S)) < 0.7
    layer = RecordingAttention(num_heads=HEADS, key_dim=HEAD_DIM)
    layer(x, y)
    query_mask = np.array([[True, True, False], [True, False, False]])
    mask = attention_mask_of_call(layer, x, y, query_mask=query_mask, value_mask=value_mask, key_mask=None,
                                  attention_mask=attention_mask, use_causal_mask=True)
    causal = np.tril(np.ones((T, S), bool))
    expected = query_mask[:, :, None] & value_mask[:, None, :] & attention_mask & causal
    np.testing.assert_array_equal(to_numpy(mask), expected)

    layer.calls.clear()
    layer(x, y, value_mask=value_mask, attention_mask=attention_mask, use_causal_mask=True)
    expected = attention_mask_of_call(layer, x, y, value_mask=value_mask, attention_mask=attention_mask,
                                      use_causal_mask=True)
    np.testing.assert_array_equal(to_numpy(layer.calls[0]["mask"]), to_numpy(expected))


def test_keras_attention_call_routes_the_projected_heads_through_its_private_compute_attention():
    """`MultiHeadAttentionWithHook` (overrides `_compute_attention`): Keras' `call` calls it once with the
    projected heads `[batch, length, heads, head_dim]`, the mask, `training` and `return_attention_scores` as
    positional arguments and no others, and projects what it returns with W^O. A class that overrides it
    gets the causal mask as a tensor (Keras' causal fast path, which passes None, is for its own method)."""
    x, y = _inputs()
    layer = RecordingAttention(num_heads=HEADS, key_dim=HEAD_DIM, answer=keras.ops.zeros_like)
    layer(x, y)
    _random_weights(layer)
    attention_mask = np.random.default_rng(3).random((B, T, S)) < 0.7
    layer.calls.clear()
    output, _ = layer(x, y, attention_mask=attention_mask, training=False, return_attention_scores=True)
    (call,) = layer.calls
    w = attention_projections(layer)
    for heads, inputs, dense in zip(call["heads"], (x, y, y), (w.query, w.key, w.value)):
        np.testing.assert_allclose(to_numpy(heads), to_numpy(dense(inputs)), rtol=1e-6)
    np.testing.assert_array_equal(to_numpy(call["mask"]), attention_mask)
    assert (call["training"], call["return_attention_scores"], call["kwargs"]) == (False, True, {})
    # The override's output (zeros here) is what W^O projects: only its bias is left.
    np.testing.assert_allclose(to_numpy(output), np.broadcast_to(to_numpy(w.output.bias), (B, T, D)), atol=1e-6)

    layer.calls.clear()
    layer(x, x, use_causal_mask=True)
    (call,) = layer.calls
    assert call["kwargs"] == {}
    np.testing.assert_array_equal(np.broadcast_to(to_numpy(call["mask"]), (B, T, T)),
                                  np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T)))


def test_the_hook_of_the_attention_base_class_gets_what_keras_gives_and_keras_own_fallback_is_keras():
    """`MultiHeadAttentionWithHook`: its public `attention_of_heads` receives the arguments of Keras' private
    `_compute_attention`, and `keras_attention_of_heads` computes what Keras' layer does; so does the library's
    layer, whether it computes the attention itself (plain) or leaves it to Keras (a gate)."""
    from keras_transformer.attention import MultiHeadAttention

    class Hooked(MultiHeadAttentionWithHook):
        def attention_of_heads(self, *args, **kwargs):
            self.seen = (len(args), kwargs)
            return super().attention_of_heads(*args, **kwargs)

    x, y = _inputs()
    mask = np.random.default_rng(4).random((B, T, S)) < 0.7
    for options in ({}, {"use_gate": True}):
        keras_layer = keras.layers.MultiHeadAttention(num_heads=HEADS, key_dim=HEAD_DIM, **options)
        keras_layer(x, y)
        _random_weights(keras_layer)
        for cls in (Hooked, MultiHeadAttention):
            layer = cls(num_heads=HEADS, key_dim=HEAD_DIM, **options)
            layer(x, y)
            layer.set_weights(keras_layer.get_weights())
            # Keras' own call (the library's plain layer computes its full pass without it).
            got = keras.layers.MultiHeadAttention.call(layer, x, y, attention_mask=mask, return_attention_scores=True)
            for a, b in zip(got, keras_layer(x, y, attention_mask=mask, return_attention_scores=True)):
                np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-5, atol=1e-5)
            if cls is Hooked:  # query, key, value, mask, training, return_attention_scores
                assert layer.seen == (6, {})


# ---------------------------------------------------------------------------------------------------------------
# kt-train's fit() (TensorFlow).


def _regression(seed=0, n=8):
    rng = np.random.default_rng(seed)
    return rng.random((n, 3), dtype="float32"), rng.random((n, 1), dtype="float32")


def _dense_model(metrics=None):
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(0.1), "mse", metrics=metrics)
    return model


def _unknown_length(batches=4):
    """A dataset of `batches` batches whose length TensorFlow does not know (as bucketed batches)."""
    import tensorflow as tf

    x, y = _regression(n=2 * batches)
    data = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(2)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return data


@tensorflow_only
def test_fit_pre_builds_through_maybe_symbolic_build_and_symbolic_build_builds_the_compiled_state():
    """`build_fit_state_now` (`_symbolic_build`, `_maybe_symbolic_build`): fit() calls the TensorFlow
    trainer's `_maybe_symbolic_build` before its first step (so replacing it skips the pre-build), and
    `_symbolic_build(data_batch=...)` builds the compiled loss and metrics from a batch, before any step."""
    x, y = _regression()
    model = _dense_model(metrics=["mae"])
    calls = []
    model._maybe_symbolic_build = lambda **kwargs: calls.append(sorted(kwargs))
    model.fit(x, y, batch_size=4, verbose=0)
    assert calls == [["iterator"]]

    model = _dense_model(metrics=["mae"])
    with pytest.raises(ValueError, match="not yet been built"):
        model.get_metrics_result()
    build_fit_state_now(model, (x[:2], y[:2]))
    assert sorted(model.get_metrics_result()) == ["loss", "mae"]
    assert model.optimizer.iterations.numpy() == 0
    assert model._maybe_symbolic_build() is None
    model.fit(x, y, batch_size=4, verbose=0)  # still trains with the pre-build turned off
    assert model.optimizer.iterations.numpy() == 2


MULTI_REPLICA_SCRIPT = """
from training.distribute import split_cpu
split_cpu(2)
import json, keras, numpy as np, tensorflow as tf
from keras_transformer.keras_internals import apply_summed_gradients
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
out = {}
# The optimizer's apply sums the replicas' gradients, unless told they are summed.
for summed in (False, True):
    with strategy.scope():
        w = keras.Variable([0.0, 0.0])
        optimizer = keras.optimizers.SGD(1.0)
        optimizer.build([w])
        if summed:
            apply_summed_gradients(optimizer)
    tf.function(lambda: strategy.run(lambda: optimizer.apply([tf.ones(2)], [w])))()
    out[f"summed={summed}"] = float(w.numpy()[0])
# fit()'s pre-build under a strategy: from its first batch averaged over the replicas.
with strategy.scope():
    model = keras.Sequential([keras.Input((3,), dtype="int32"), keras.layers.Embedding(10, 2),
                              keras.layers.Flatten(), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
dtypes, build = [], model._symbolic_build
def recording(iterator=None, data_batch=None):
    dtypes.append([t.dtype.name for t in tf.nest.flatten(data_batch)])
    return build(iterator=iterator, data_batch=data_batch)
model._symbolic_build = recording
model.fit(np.ones((8, 3), "int32"), np.ones((8, 1), "float32"), batch_size=4, verbose=0)
out["pre-build dtypes"] = dtypes
print(json.dumps(out))
"""


@tensorflow_only
def test_on_two_replicas_apply_all_reduces_the_gradients_and_fit_pre_builds_from_a_mean_batch():
    """`apply_summed_gradients` and `build_fit_state_now`, on two replicas (logical CPUs, hence a program): a
    gradient of 1 on each replica moves SGD(1) by 2 (Keras all-reduces what `apply` is given) unless
    `_all_reduce_sum_gradients` is replaced (by 1); fit()'s own pre-build sees the int token ids as floats
    (the first batch reduced with MEAN), the reason kt-train builds from an int batch itself."""
    done = subprocess.run([sys.executable, "-c", MULTI_REPLICA_SCRIPT], cwd=REPO, env=distributed_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (ids, labels), = out.pop("pre-build dtypes")  # one pre-build, from a batch of int32 ids
    assert ids.startswith("float") and labels == "float32"
    assert out == {"summed=False": -2.0, "summed=True": -1.0}


@tensorflow_only
def test_the_tensorflow_optimizer_all_reduces_in_its_private_all_reduce_sum_gradients():
    """`apply_summed_gradients` (`_all_reduce_sum_gradients`): `apply` hands its (gradient, variable) pairs
    to that method and updates with the pairs it returns."""
    w = keras.Variable([1.0, 1.0])
    optimizer = keras.optimizers.SGD(1.0)
    optimizer.build([w])
    seen = []

    def halving(grads_and_vars):
        pairs = list(grads_and_vars)
        seen.append(len(pairs))
        return [(g / 2, v) for g, v in pairs]

    optimizer._all_reduce_sum_gradients = halving
    optimizer.apply([keras.ops.ones(2)], [w])
    assert seen == [1]
    np.testing.assert_allclose(to_numpy(w), [0.5, 0.5])
    apply_summed_gradients(optimizer)
    optimizer.apply([keras.ops.ones(2)], [w])
    np.testing.assert_allclose(to_numpy(w), [-0.5, -0.5])


@tensorflow_only
def test_fit_averages_the_step_logs_over_workers_with_a_reduction_over_axis_0(monkeypatch):
    """`rank1_step_logs`: under a multi-worker strategy, Keras' fit() reduces each step's logs with
    `strategy.reduce("MEAN", v, axis=0)` (in `reduce_per_replica`), which a scalar log cannot take and a
    rank-1 one can, giving the same logs. (The multi-worker test of `_collective_all_reduce_multi_worker` is
    made true, so that the default strategy takes that branch in one process.)"""
    from keras.src.backend.tensorflow import trainer

    x, y = _regression()
    keras.utils.set_random_seed(0)
    expected = _dense_model(metrics=["mae"]).fit(x, y, batch_size=4, verbose=0, shuffle=False).history
    monkeypatch.setattr(trainer, "_collective_all_reduce_multi_worker", lambda strategy: True)
    with pytest.raises(ValueError, match="Invalid reduction dimension 0 for input with 0 dimensions"):
        _dense_model(metrics=["mae"]).fit(x, y, batch_size=4, verbose=0)
    keras.utils.set_random_seed(0)
    model = _dense_model(metrics=["mae"])
    rank1_step_logs(model)
    history = model.fit(x, y, batch_size=4, verbose=0, shuffle=False).history
    assert history.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(history[name], expected[name], rtol=1e-6)


@tensorflow_only
@pytest.mark.filterwarnings(f"ignore:{RAN_OUT_OF_DATA}")
def test_fit_ends_an_epoch_of_unknown_length_with_a_step_that_counts_an_update_without_a_batch():
    """`no_step_without_data`: Keras' TensorFlow trainer runs the step's ops that do not read the batch in the
    step whose `get_next()` ends the epoch: 4 batches count 5 optimizer steps. Tracing the step (the
    `model.train_step` attribute, which fit() reads) under a dependency on the batch counts 4. Should the first
    count become 4 after a Keras upgrade, Keras no longer runs that step and the function can go."""
    counts = []
    for fixed in (False, True):
        model = _dense_model()
        if fixed:
            no_step_without_data(model)
        model.fit(_unknown_length(4), verbose=0, shuffle=False)
        counts.append(int(model.optimizer.iterations.numpy()))
    assert counts == [5, 4]


@tensorflow_only
def test_fit_warns_that_the_input_ran_out_of_data_when_an_epoch_of_unknown_length_ends():
    """`ignoring_ran_out_of_data` (`EpochIterator.catch_stop_iteration`): Keras warns `RAN_OUT_OF_DATA` (a
    UserWarning) at the end of each epoch of unknown length; inside the block it does not, and other warnings
    still pass."""
    with pytest.warns(UserWarning, match=RAN_OUT_OF_DATA):
        _dense_model().fit(_unknown_length(), verbose=0, shuffle=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ignoring_ran_out_of_data():
            _dense_model().fit(_unknown_length(), verbose=0, shuffle=False)
            warnings.warn("another warning")
    assert [str(w.message) for w in caught if RAN_OUT_OF_DATA in str(w.message)] == []
    assert "another warning" in [str(w.message) for w in caught]


class RecordingBackup(BackupAndRestoreState):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.saves = []

    def save_backup(self):
        self.saves.append((self.current_epoch, self.last_batch_seen))
        super().save_backup()


@tensorflow_only
def test_keras_backup_writes_through_private_save_model_at_its_private_paths(tmp_path):
    """`BackupAndRestoreState` (`_save_model`, `_weights_path`, `_training_metadata_path`, `_prev_*`,
    `_current_epoch`, `_last_batch_seen`): Keras' `on_epoch_end` writes each backup through `_save_model`
    (so `save_backup` is called once an epoch), at those paths, the previous pair moved to the `_prev_`
    ones, with `{"epoch": _current_epoch, "batch": _last_batch_seen}` as metadata."""
    x, y = _regression()
    model = _dense_model()
    backup = RecordingBackup(str(tmp_path / "backup"), double_checkpoint=True, delete_checkpoint=False)
    model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[backup])
    assert backup.saves == [(1, 0), (2, 0)]
    assert (backup.weights_path, backup.metadata_path) == (tmp_path / "backup" / "latest.weights.h5",
                                                           tmp_path / "backup" / "training_metadata.json")
    assert backup.previous_paths == [(backup.weights_path, tmp_path / "backup" / "latest.weights.h5.bkp"),
                                     (backup.metadata_path, tmp_path / "backup" / "training_metadata.json.bkp")]
    assert sorted(p.name for p in (tmp_path / "backup").iterdir()) == sorted(
        p.name for pair in backup.previous_paths for p in pair)
    assert json.loads(backup.metadata_path.read_text()) == {"epoch": 2, "batch": 0}
    assert json.loads(backup.previous_paths[1][1].read_text()) == {"epoch": 1, "batch": 0}
    backup.current_epoch, backup.last_batch_seen = 7, 3
    backup.save_backup()
    assert json.loads(backup.metadata_path.read_text()) == {"epoch": 7, "batch": 3}
    # Keras itself sets `_last_batch_seen` only when it decides to save on a batch (`_should_save_on_batch`).
    keras_backup = keras.callbacks.BackupAndRestore(str(tmp_path / "other"), save_freq=100)
    keras_backup.on_train_batch_end(5)
    assert keras_backup._last_batch_seen == 5


@tensorflow_only
def test_keras_restore_sets_the_private_initial_epoch_that_fit_starts_at(tmp_path):
    """`BackupAndRestoreState.load_backup` and `start_fit_at` (`model._initial_epoch`, `_load_model`,
    `_current_epoch`): Keras' own restore sets `model._initial_epoch` from the metadata and leaves `_current_epoch`
    at 0 (the setter's reason), and fit() starts at `model._initial_epoch`, whatever its `initial_epoch`
    argument, set by a callback's `on_train_begin` too."""
    x, y = _regression()
    model = _dense_model()
    model.fit(x, y, batch_size=4, verbose=0)
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    backup.set_model(model)
    backup._current_epoch = 2
    backup._save_model()
    restored = _dense_model()
    restored.build((None, 3))
    keras_restore = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    keras_restore.set_model(restored)
    keras_restore.on_train_begin()
    assert (restored._initial_epoch, keras_restore._current_epoch) == (2, 0)

    ours = _dense_model()
    ours.build((None, 3))
    state = BackupAndRestoreState(str(tmp_path / "other"))
    state.set_model(ours)
    meta = state.load_backup(tmp_path / "backup" / "latest.weights.h5", tmp_path / "backup" / "training_metadata.json")
    assert (meta, ours._initial_epoch) == ({"epoch": 2, "batch": 0}, 2)
    history = ours.fit(x, y, batch_size=4, epochs=4, verbose=0)
    assert history.epoch == [2, 3]
    state.on_train_begin = lambda logs=None: state.start_fit_at(1)
    assert ours.fit(x, y, batch_size=4, epochs=4, verbose=0, callbacks=[state]).epoch == [1, 2, 3]


@tensorflow_only
def test_a_stop_set_after_a_batch_ends_the_epoch_and_fit_goes_on_if_it_is_cleared_at_the_epoch_end():
    """`EpochCut` (`model.stop_training`, fit's loop): with `steps_per_epoch`, `stop_training` set in
    `on_train_batch_end` ends the epoch's loop over batches, and fit ends after `on_epoch_end` only if it is
    still set then; cleared there, fit's next epoch reads on from the same dataset iterator, its steps whole.
    A stop another callback set before the cut stands."""
    import tensorflow as tf

    x = np.arange(40, dtype="float32").reshape(40, 1)
    data = tf.data.Dataset.from_tensor_slices((x, x)).batch(1).repeat()

    def fit(*callbacks, cut_after=3):
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.0), "mse", run_eagerly=True)
        seen, step = [], model.train_step
        model.train_step = lambda batch: seen.append(int(batch[0][0, 0])) or step(batch)
        cut = EpochCut()
        cut.cut_after(cut_after)
        goes_on = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: cut.go_on())
        history = model.fit(data, epochs=3, steps_per_epoch=5, verbose=0, shuffle=False,
                            callbacks=[goes_on, *callbacks, cut])
        return history.epoch, seen

    assert fit() == ([0, 1, 2], list(range(3 + 5 + 5)))
    stops = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: setattr(
        stops.model, "stop_training", batch == 2))
    assert fit(stops) == ([0], [0, 1, 2])
    with pytest.raises(ValueError, match="at least one batch"):
        EpochCut().cut_after(0)


@tensorflow_only
def test_keras_progress_bar_prints_its_epoch_line_only_for_more_than_one_epoch(capsys):
    """`UpdateBoundProgbar` (`ProgbarLogger.epochs`): Keras' progress bar takes `epochs` from fit's params and
    prints "Epoch N/M" only when it is above 1; fit() adds its own progress bar only when none is given."""
    x, y = _regression()
    _dense_model().fit(x, y, batch_size=4, epochs=2, verbose=1)
    assert "Epoch 1/2" in capsys.readouterr().out
    _dense_model().fit(x, y, batch_size=4, epochs=2, verbose=1, callbacks=[UpdateBoundProgbar(8060)])
    out = capsys.readouterr().out
    assert "Epoch 1 (to update 8,060)" in out and "Epoch 2 (to update 8,060)" in out
    assert "Epoch 1/2" not in out and "Epoch 2/2" not in out and out.count("Epoch 1") == 1


@tensorflow_only
def test_fit_logs_as_loss_the_result_of_the_private_loss_tracker():
    """`loss_tracker` (`_loss_tracker`): compile creates it, a `Mean` named "loss" and the first of
    `model.metrics`, and fit()'s "loss" log is its result, averaged over the epoch, for a step of one's own
    that updates it (as `keras_transformer.distributed.UpdateStep` does) and returns `compute_metrics`."""
    model = _dense_model()
    tracker = loss_tracker(model)
    assert isinstance(tracker, keras.metrics.Mean) and tracker.name == "loss" and model.metrics[0] is tracker
    steps = keras.Variable(0.0, trainable=False)

    def train_step(data):
        x, y = data
        y_pred = model(x)
        steps.assign_add(1.0)
        tracker.update_state(steps.value)  # steps 1, 2 in the first epoch, 3, 4 in the second
        return model.compute_metrics(x, y, y_pred)

    model.train_step = train_step
    x, y = _regression()
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert history.history["loss"] == [1.5, 3.5]


def test_every_use_has_a_test_here():
    """Every function and class of both keras_internals modules (each a use of private Keras API;
    `AttentionProjections` is the tuple `attention_projections` returns) is named in the docstring of a test of
    this file."""
    uses = {name for module in (keras_internals, training_keras_internals) for name, value in vars(module).items()
            if not name.startswith("_") and getattr(value, "__module__", None) == module.__name__}
    docstrings = " ".join(test.__doc__ for name, test in globals().items()
                          if name.startswith("test_") and name != "test_every_use_has_a_test_here")
    assert {"attention_projections", "loss_tracker", "BackupAndRestoreState"} <= uses
    assert sorted(u for u in uses - {"AttentionProjections"} if f"`{u}" not in docstrings) == []
