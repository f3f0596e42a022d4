"""Trains the same updates on one replica and on several, for tests/test_training_updates.py (a program: logical
CPU devices and multi-worker strategies must be set up before TensorFlow starts).

    python tests/replica_updates.py OUT.json REPLICAS [CASE ...]  # REPLICAS logical CPU devices (MirroredStrategy; 1: default)
    TF_CONFIG=... python tests/replica_updates.py OUT.json workers [CASE ...]  # a worker of a MultiWorkerMirroredStrategy

Without CASEs it trains every case.

For each case it trains 3 updates of a tiny Transformer (dropout off, SGD, so a gradient's scale shows in the
weights) on the same global batches, whose halves hold different numbers of real target tokens, with kt-train's
own `build_and_compile` (its `UpdateStep`), and writes the weights after each update (the chief's, for workers),
then `evaluate`s the trained model on the same batches.
Case "overflow" (mixed_float16, a one-layer model under the same `UpdateStep`) makes the first batch's second
half overflow and writes the loss scale, the optimizer's step and every replica's copy of the weights after each
batch.
Cases "own-script" and "own-script-overflow" train as a user's own script does, with nothing of training/: a
`kt.Transformer` compiled in the strategy's scope with a Keras optimizer that clips (`global_clipnorm`) and
accumulates (`gradient_accumulation_steps`), the library's loss and metric, then `model.fit`; the second under
mixed_float16, with a sample weight that overflows on the second replica's share of the first batch.
The linear cases (LINEAR_CASES: "scaled-overflow", "scaled-clip", ...) train a model of one `Dense` layer over
float features, in float32, under `UpdateStep`, on global batches whose halves hold very different numbers of
real target tokens, some with loss scaling (a `LossScaleOptimizer`, as Keras wraps the optimizer under
mixed_float16), a clip, an overflow (an infinite feature) in one batch's second half; they write the batches
and, after each batch, what `EachBatch` records, for the test to compare with the update it computes by hand.
"""

import inspect
import json
import sys

OUT, MODE = sys.argv[1], sys.argv[2]
if MODE != "workers" and int(MODE) > 1:
    from training.distribute import split_cpu

    split_cpu(int(MODE))  # before TensorFlow initializes its devices

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from training.config import TrainSettings  # noqa: E402
from training.distribute import make_strategy, worker_info  # noqa: E402
from training.fit import build_and_compile  # noqa: E402
from keras_transformer.keras_internals import build_fit_state_now  # noqa: E402
from keras_transformer.distributed import UpdateStep  # noqa: E402

import keras_transformer as kt  # noqa: E402

V, L, ROWS, UPDATES = 50, 10, 8, 3  # vocabulary, padded length, rows per global batch, updates
LEARNING_RATE = 0.5
CASES = {
    # name: (batches per update, global clip norm, R-Drop weight)
    "clip": (1, 0.05, None),
    "accumulate": (3, None, None),
    "clip+accumulate": (3, 0.05, None),
    "r-drop": (2, None, 1.0),
}
OWN_SCRIPT = (3, 0.05)  # the own-script case's batches per update and global clip norm
# The linear cases: batches per update, updates, the LossScaleOptimizer's initial scale (None: no loss scaling),
# the update step's global clip norm, the optimizer's own, and the batch (0-based) whose second half (replica 2's
# share on two replicas) holds an infinite feature. Each scaled case grows the scale after 2 finite updates.
LINEAR_CASES = {
    # the second batch of update 2 overflows: update 2 is skipped, the scale halves; updates 3 and 4 are applied,
    # the scale doubles again after update 4
    "scaled-overflow": dict(accumulate=2, updates=4, scale=2.0 ** 15, step_clip=None, own_clip=None, overflow=3),
    # a scale of 2^20 on a clipped update: the clip must see the unscaled gradient
    "scaled-clip": dict(accumulate=2, updates=2, scale=2.0 ** 20, step_clip=0.05, own_clip=None, overflow=None),
    "scaled-own-clip": dict(accumulate=1, updates=2, scale=2.0 ** 20, step_clip=None, own_clip=0.05, overflow=None),
    "unequal-tokens": dict(accumulate=1, updates=2, scale=None, step_clip=None, own_clip=None, overflow=None),
    "unequal-tokens+accumulate": dict(accumulate=2, updates=2, scale=None, step_clip=None, own_clip=None,
                                      overflow=None),
}
LINEAR_FEATURES, LINEAR_CLASSES = 8, 20
TRACKED = ("embedding", "encoder/layer_0/self_attention/query", "decoder/layer_0/feed_forward")  # a few weights are enough to tell updates apart


def batches(count, rng, pairs=False):
    """`count` global batches ((source, target_in), target_out) of ROWS rows; each half (a replica's share of
    two) holds its own random lengths, so the halves' real target tokens differ. With `pairs`, rows 2i and
    2i + 1 are the same sentence (R-Drop's batches)."""
    out = []
    for _ in range(count):
        n = ROWS // 2 if pairs else ROWS
        source = rng.integers(4, V, size=(n, L)).astype("int32")
        target = np.zeros((n, L + 1), "int32")
        for row, length in enumerate(rng.integers(1, L, size=n)):
            target[row, 0] = 2
            target[row, 1:length + 1] = rng.integers(4, V, size=length)
            target[row, length + 1] = 3
        if pairs:
            source, target = np.repeat(source, 2, axis=0), np.repeat(target, 2, axis=0)
        out.append(((source, target[:, :-1]), target[:, 1:]))
    return out


def dataset(data, sample_weights=None):
    def gen():
        for i, ((s, ti), to) in enumerate(data):
            yield ((s, ti), to) if sample_weights is None else ((s, ti), to, sample_weights[i])

    spec = (tf.TensorSpec([None, L], tf.int32),) * 2
    signature = (spec, tf.TensorSpec([None, L], tf.int32))
    if sample_weights is not None:
        signature += (tf.TensorSpec([None], tf.float32),)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_generator(gen, output_signature=signature).with_options(options)


def config(accumulate, clip, r_drop, **extra):
    return TrainSettings(preset="tiny", model={"dropout": 0.0, "num_encoder_layers": 1, "num_decoder_layers": 1},
                         warmup_steps=10, grad_accum=accumulate, global_clipnorm=clip, r_drop=r_drop, **extra)


def tracked(model):
    return {v.path: keras.ops.convert_to_numpy(v).tolist() for v in model.trainable_variables
            if any(name in v.path for name in TRACKED)}


class Record(keras.callbacks.Callback):
    """After each update (when the optimizer's step moves): the tracked weights, the logged loss and the
    update's global L2 norm over every weight."""

    def __init__(self):
        super().__init__()
        self.updates, self.step = [], 0

    def on_train_begin(self, logs=None):
        self.before = [keras.ops.convert_to_numpy(v) for v in self.model.trainable_variables]
        self.start = tracked(self.model)

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step != self.step:
            after = [keras.ops.convert_to_numpy(v) for v in self.model.trainable_variables]
            norm = float(np.sqrt(sum(np.sum((a.astype("float64") - b) ** 2) for a, b in zip(after, self.before))))
            self.step, self.before = step, after
            self.updates.append({"step": step, "loss": float(logs["loss"]), "norm": norm,
                                 "weights": tracked(self.model)})


def first_update_by_definition(model, data, learning_rate):
    """The tracked weights after one SGD step on all of `data` by the definition of the update's loss (the mean
    over all its real target tokens), and by a mean of per-batch means instead."""
    loss = model.loss
    with tf.GradientTape(persistent=True) as tape:
        sums, counts, means = [], [], []
        for (s, ti), to in data:
            total, count = loss.token_sum_and_count(to, model((s, ti), training=True))
            sums.append(total), counts.append(count), means.append(total / count)
        by_tokens = tf.add_n(sums) / tf.add_n(counts)
        by_batches = tf.add_n(means) / len(means)
    out = {}
    for name, value in (("by_tokens", by_tokens), ("by_batches", by_batches)):
        grads = tape.gradient(value, model.trainable_variables)
        out[name] = {v.path: (keras.ops.convert_to_numpy(v) - learning_rate * g.numpy()).tolist()
                     for v, g in zip(model.trainable_variables, grads) if any(n in v.path for n in TRACKED)}
    out["token_counts"] = [float(c) for c in counts]
    return out


def own_script_case(strategy, overflow=False):
    """As a user's script: `kt.Transformer` compiled in the scope with Keras' SGD clipping and accumulating, then
    `model.fit`, nothing else. With `overflow`, mixed_float16 and sample weights of 1 except a huge one on a
    row of the first batch's second half (replica 2's share on two replicas): that batch's gradient overflows."""
    accumulate, clip = (1, None) if overflow else OWN_SCRIPT
    rng = np.random.default_rng(11)
    data = batches(UPDATES * accumulate + (1 if overflow else 0), rng)
    weights = None
    if overflow:
        keras.mixed_precision.set_global_policy("mixed_float16")
        weights = np.ones((len(data), ROWS), "float32")
        weights[0, ROWS // 2 + 1] = 3e38  # float32's largest is 3.4e38: times the loss scale, the gradient is not finite
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = kt.Transformer.from_preset("tiny", vocab_size=V, dropout=0.0, num_encoder_layers=1,
                                           num_decoder_layers=1)
        optimizer = keras.optimizers.SGD(LEARNING_RATE, global_clipnorm=clip,
                                         gradient_accumulation_steps=accumulate if accumulate > 1 else None)
        model.compile(optimizer=optimizer, loss=kt.MaskedSparseCategoricalCrossentropy(),
                      metrics=[kt.MaskedAccuracy()])
    record = Record()
    # TerminateOnNaN, as kt-train runs: a skipped batch's non-finite loss must not reach the logs and stop the run.
    model.fit(dataset(data, weights), epochs=1, verbose=0, callbacks=[record, keras.callbacks.TerminateOnNaN()])
    evaluated = model.evaluate(dataset(data), verbose=0, return_dict=True)["loss"]
    out = {"start": record.start, "updates": record.updates, "replicas": strategy.num_replicas_in_sync,
           "evaluated": evaluated, "accumulate": accumulate}
    if overflow:
        out["loss_scale"] = float(model.optimizer.dynamic_scale.numpy())
        out["initial_scale"] = float(model.optimizer.initial_scale)
        keras.mixed_precision.set_global_policy("float32")
    if strategy.num_replicas_in_sync == 1:  # the definition: the mean over every real target token
        sums = [model.loss.token_sum_and_count(to, model((s, ti), training=False)) for (s, ti), to in data]
        out["definition"] = {"loss": float(sum(t for t, _ in sums) / sum(c for _, c in sums))}
    return out


def train_case(strategy, name):
    accumulate, clip, r_drop = CASES[name]
    rng = np.random.default_rng(7)
    data = batches(UPDATES * accumulate, rng, pairs=bool(r_drop))
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = build_and_compile(config(accumulate, clip, r_drop), V, keras.optimizers.SGD(LEARNING_RATE))
    start = tracked(model)
    definition = (first_update_by_definition(model, data[:accumulate], LEARNING_RATE)
                  if name == "accumulate" and strategy.num_replicas_in_sync == 1 else None)
    record = Record()
    model.fit(dataset(data), epochs=1, verbose=0, callbacks=[record])
    evaluated = model.evaluate(dataset(data), verbose=0, return_dict=True)["loss"]
    if strategy.num_replicas_in_sync == 1:  # the definition: the mean over every real target token
        sums = [model.loss.token_sum_and_count(to, model((s, ti), training=False)) for (s, ti), to in data]
        definition = {**(definition or {}), "loss": float(sum(t for t, _ in sums) / sum(c for _, c in sums))}
    return {"start": start, "updates": record.updates, "replicas": strategy.num_replicas_in_sync,
            "definition": definition, "evaluated": evaluated}


class EachBatch(keras.callbacks.Callback):
    """After each batch: the optimizer's step, the batches accumulated towards the next update, the loss scale and
    `LossScaleOptimizer`'s count of finite updates (None without loss scaling), and every replica's copy of every
    weight."""

    def __init__(self):
        super().__init__()
        self.steps = []

    def on_train_batch_end(self, batch, logs=None):
        optimizer = self.model.optimizer
        scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        self.steps.append({
            "loss_scale": float(optimizer.dynamic_scale.numpy()) if scaled else None,
            "step_counter": int(optimizer.step_counter.numpy()) if scaled else None,
            "step": int(optimizer.iterations.numpy()),
            "pending": inspect.unwrap(self.model.train_step).pending(),
            "replica_weights": [[c.numpy().tolist() for c in getattr(w.value, "values", (w.value,))]
                                for w in self.model.trainable_variables],
        })


def overflow_case(strategy):
    """mixed_float16, a model of one `Dense` layer over float features, trained by `UpdateStep` with the
    library's loss: the first batch's second half (replica 2's share on two replicas) holds a feature beyond
    float16's range, so its loss and gradient overflow; the second batch is finite."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    rng = np.random.default_rng(3)
    features = rng.normal(size=(2, ROWS, L, 8)).astype("float32")
    features[0, ROWS // 2 + 1, 2] = 6e4  # float16's largest is 65504: the matmul overflows
    labels = rng.integers(1, V, size=(2, ROWS, L)).astype("int32")
    data = tf.data.Dataset.from_tensor_slices((features, labels))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((L, 8)), keras.layers.Dense(V)])
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE), loss=kt.MaskedSparseCategoricalCrossentropy())
        model.optimizer.build(model.trainable_variables)
        build_fit_state_now(model, (features[0, :2], labels[0, :2]))
        UpdateStep.install(model)
    each = EachBatch()
    start = [keras.ops.convert_to_numpy(w).tolist() for w in model.trainable_variables]
    model.fit(data.with_options(options), epochs=1, verbose=0, callbacks=[each])
    keras.mixed_precision.set_global_policy("float32")
    return {"start": start, "steps": each.steps, "initial_scale": float(model.optimizer.initial_scale)}


def linear_case(strategy, name):
    """LINEAR_CASES[name]: a `Dense` layer over float features, float32, the library's loss, SGD (in a
    `LossScaleOptimizer` when the case scales the loss), trained by `UpdateStep` on global batches of ROWS rows
    whose first half holds 7 to 10 real target tokens a row and the second 1 to 3. Writes the batches, the
    starting weights and `EachBatch`'s records."""
    case = LINEAR_CASES[name]
    rng = np.random.default_rng(5)
    count = case["accumulate"] * case["updates"]
    features = rng.normal(size=(count, ROWS, L, LINEAR_FEATURES)).astype("float32")
    labels = np.zeros((count, ROWS, L), "int32")
    for batch in range(count):
        for row in range(ROWS):
            length = rng.integers(L - 3, L + 1) if row < ROWS // 2 else rng.integers(1, 4)
            labels[batch, row, :length] = rng.integers(1, LINEAR_CLASSES, size=length)
    if case["overflow"] is not None:
        features[case["overflow"], ROWS // 2 + 1, 0, 0] = np.inf
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((features, labels)).with_options(options)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((L, LINEAR_FEATURES)), keras.layers.Dense(LINEAR_CLASSES)])
        optimizer = keras.optimizers.SGD(LEARNING_RATE, global_clipnorm=case["own_clip"])
        if case["scale"] is not None:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=case["scale"],
                                                            dynamic_growth_steps=2)
        model.compile(optimizer=optimizer, loss=kt.MaskedSparseCategoricalCrossentropy())
        model.optimizer.build(model.trainable_variables)
        build_fit_state_now(model, (features[0, :2], labels[0, :2]))
        UpdateStep.install(model, accumulate=case["accumulate"], global_clipnorm=case["step_clip"])
    each = EachBatch()
    start = [keras.ops.convert_to_numpy(w).tolist() for w in model.trainable_variables]
    model.fit(data, epochs=1, verbose=0, shuffle=False, callbacks=[each])
    return {"features": features.tolist(), "labels": labels.tolist(), "start": start, "steps": each.steps,
            "replicas": strategy.num_replicas_in_sync, **case}


def main():
    strategy = make_strategy(1) if MODE == "workers" else (
        tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(int(MODE))]) if int(MODE) > 1
        else tf.distribute.get_strategy())
    cases = sys.argv[3:] or [*CASES, "overflow", "own-script", "own-script-overflow", *LINEAR_CASES]
    run = {"overflow": overflow_case, "own-script": own_script_case,
           "own-script-overflow": lambda strategy: own_script_case(strategy, overflow=True)}
    run.update({name: lambda strategy, name=name: linear_case(strategy, name) for name in LINEAR_CASES})
    results = {name: run[name](strategy) if name in run else train_case(strategy, name) for name in cases}
    if worker_info()[0]:
        with open(OUT, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
