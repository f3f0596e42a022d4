"""Your own Keras model of the library's layers under MirroredStrategy, for tests/test_fit_under_strategy.py (a
program: logical CPU devices must be set up before TensorFlow starts).

    python tests/strategy_fit.py OUT.json

On 2 logical CPU devices, in one process, it trains the same language model (`conftest.gpt_model`: embedding,
decoder without cross-attention, projection) with plain `model.fit` on the default strategy (one device) and
on a 2-replica MirroredStrategy, first with Keras' own step (the library's loss sees every replica's tokens),
then with `kt.UpdateStep.install` and an optimizer that clips; the global batches' halves hold different numbers
of real tokens. It also records the errors of what is refused: a `kt.Transformer` compiled with another loss and a
clipping optimizer on 2 replicas, and one built outside the strategy's scope.
"""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer as kt  # noqa: E402
from conftest import gpt_model  # noqa: E402

VOCAB, LENGTH, ROWS, STEPS, LEARNING_RATE, CLIP = 30, 12, 8, 3, 0.5, 0.02


def lm_batches():
    """STEPS global batches (ids, next ids) of ROWS rows; the first half's rows are longer than the second's."""
    rng = np.random.default_rng(5)
    ids = rng.integers(1, VOCAB, size=(STEPS * ROWS, LENGTH + 1)).astype("int32")
    for row in range(len(ids)):
        real = rng.integers(LENGTH // 2, LENGTH + 1) if row % ROWS < ROWS // 2 else rng.integers(2, LENGTH // 3)
        ids[row, real + 1:] = 0
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((ids[:, :-1], ids[:, 1:])).batch(ROWS).with_options(options)


def train_lm(strategy, install):
    with strategy.scope():
        keras.utils.set_random_seed(3)
        model = gpt_model(vocab=VOCAB)
        clip = {"global_clipnorm": CLIP} if install else {}
        model.compile(optimizer=keras.optimizers.SGD(LEARNING_RATE, **clip),
                      loss=kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.0))
        if install:
            kt.UpdateStep.install(model)
    start = [w.numpy() for w in model.trainable_variables]
    history = model.fit(lm_batches(), epochs=1, verbose=0)
    weights = [w.numpy() for w in model.trainable_variables]
    moved = float(max(np.max(np.abs(a - b)) for a, b in zip(weights, start)))
    return {"weights": [w.tolist() for w in weights], "loss": history.history["loss"][-1], "moved": moved,
            "replicas": strategy.num_replicas_in_sync}


def refused(make):
    try:
        make()
    except ValueError as e:
        return str(e)
    return None


def other_loss_with_a_clip(strategy):
    with strategy.scope():
        model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB)
        model.compile(optimizer=keras.optimizers.SGD(0.1, global_clipnorm=1.0),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


def built_outside_the_scope(strategy):
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB)
    ids = np.ones((2, 3), "int32")
    model((ids, ids))
    with strategy.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=kt.MaskedSparseCategoricalCrossentropy())
        model.fit(tf.data.Dataset.from_tensor_slices(((ids, ids), ids)).batch(2), verbose=0)


def main():
    one, two = tf.distribute.get_strategy(), tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    results = {f"lm-{'installed' if install else 'keras'}-{strategy.num_replicas_in_sync}": train_lm(strategy, install)
               for install in (False, True) for strategy in (one, two)}
    results["refused-other-loss"] = refused(lambda: other_loss_with_a_clip(two))
    results["refused-outside-scope"] = refused(lambda: built_outside_the_scope(two))
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
