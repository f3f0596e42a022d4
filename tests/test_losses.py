"""The label-smoothed loss and token accuracy ignore padding and follow their formulas."""

import keras
import numpy as np
import pytest

import keras_transformer as kt


def _reference(labels, logits, eps):
    """Cross-entropy against (1 - eps) one-hot + eps / V, averaged over real tokens."""
    vocab = logits.shape[-1]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = np.eye(vocab)[labels] * (1 - eps) + eps / vocab
    per_token = -(target * log_probs).sum(-1)
    mask = labels != 0
    return per_token[mask].mean()


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_matches_the_formula_and_ignores_padding(eps):
    rng = np.random.default_rng(0)
    labels = rng.integers(1, 9, size=(3, 5))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    logits = rng.normal(size=(3, 5, 9)).astype("float32") * 3
    loss = float(kt.MaskedSparseCategoricalCrossentropy(label_smoothing=eps)(labels, logits))
    assert loss == pytest.approx(_reference(labels, logits, eps), rel=1e-5)
    # Keras' own smoothed categorical cross-entropy agrees on the real tokens.
    mask = labels != 0
    keras_loss = keras.losses.CategoricalCrossentropy(from_logits=True, label_smoothing=eps)(
        np.eye(9)[labels[mask]], logits[mask]
    )
    assert loss == pytest.approx(float(keras_loss), rel=1e-5)
    # Whatever the logits at padded positions, the loss is the same.
    logits[0, 3:] = 100.0
    assert float(kt.MaskedSparseCategoricalCrossentropy(label_smoothing=eps)(labels, logits)) == pytest.approx(loss, rel=1e-5)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_loss_gradient_is_softmax_minus_the_smoothed_target(eps):
    # The loss has a hand-written gradient; it must equal automatic differentiation
    # of the textbook formula, (1 - eps) * -log p_y + eps * mean(-log p), on real tokens only.
    import tensorflow as tf

    rng = np.random.default_rng(1)
    labels = rng.integers(1, 9, size=(3, 5))
    labels[1, 2:] = 0
    logits = tf.constant(rng.normal(size=(3, 5, 9)).astype("float32") * 30)  # large: no overflow either
    mask = tf.cast(labels != 0, tf.float32)

    with tf.GradientTape(persistent=True) as tape:
        tape.watch(logits)
        ours = tf.reduce_sum(kt.MaskedSparseCategoricalCrossentropy(label_smoothing=eps).call(labels, logits))
        log_probs = tf.nn.log_softmax(logits)
        per_token = (1 - eps) * -tf.gather(log_probs, labels, axis=-1, batch_dims=2) + eps * -tf.reduce_mean(
            log_probs, axis=-1
        )
        reference = tf.reduce_sum(per_token * mask) * (labels.size / tf.reduce_sum(mask))
    np.testing.assert_allclose(float(ours), float(reference), rtol=1e-5)
    grad, reference_grad = tape.gradient(ours, logits), tape.gradient(reference, logits)
    assert np.isfinite(grad.numpy()).all()
    np.testing.assert_allclose(grad.numpy(), reference_grad.numpy(), atol=1e-6)
    assert (grad.numpy()[1, 2:] == 0).all()  # padding gets no gradient


def test_masked_accuracy_counts_real_tokens_across_batches():
    metric = kt.MaskedAccuracy()
    labels = np.array([[1, 2, 0, 0], [3, 4, 5, 0]])
    logits = np.eye(6)[[[1, 5, 0, 0], [3, 4, 1, 1]]].astype("float32")
    metric.update_state(labels, logits)  # 3 right of 5 real tokens
    metric.update_state(np.array([[2, 0]]), np.eye(6)[[[2, 2]]].astype("float32"))  # 1 of 1
    assert float(metric.result()) == pytest.approx(4 / 6)


def test_loss_is_divided_by_the_replicas_under_tf_distribute():
    """Keras sums the replicas' gradients, so each replica's loss must carry 1/N.

    Logical CPU devices must exist before TensorFlow starts: a subprocess.
    """
    script = """
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import numpy as np, keras_transformer as kt
labels = np.array([[3, 4, 0], [5, 0, 0]])
logits = np.random.default_rng(0).normal(size=(2, 3, 6)).astype("float32")
loss = kt.MaskedSparseCategoricalCrossentropy()
alone = float(loss(labels, logits))
with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
    per_replica = tf.distribute.get_strategy().run(lambda: loss(labels, logits))
print(alone, float(per_replica.values[0]), float(per_replica.values[1]))
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    alone, first, second = map(float, done.stdout.split()[-3:])
    assert first == pytest.approx(alone / 2, rel=1e-6) and second == pytest.approx(alone / 2, rel=1e-6)
