"""The label-smoothed loss and token accuracy ignore padding and follow their formulas."""

import keras
import numpy as np
import pytest

import keras_transformer as kt


def _reference_per_token(labels, logits, eps):
    """Cross-entropy against (1 - eps) one-hot + eps / V at every position."""
    vocab = logits.shape[-1]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    target = np.eye(vocab)[labels] * (1 - eps) + eps / vocab
    return -(target * log_probs).sum(-1)


def _reference(labels, logits, eps):
    """The smoothed cross-entropy averaged over real tokens."""
    return _reference_per_token(labels, logits, eps)[labels != 0].mean()


def _padded_batch(seed):
    """Labels with padding in two rows, and logits."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, 9, size=(3, 5))
    labels[0, 3:] = 0
    labels[2, 1:] = 0
    return labels, rng.normal(size=(3, 5, 9)).astype("float32") * 3


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_loss_matches_the_formula_and_ignores_padding(eps):
    labels, logits = _padded_batch(0)
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
        ours = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=eps)(labels, logits)
        log_probs = tf.nn.log_softmax(logits)
        per_token = (1 - eps) * -tf.gather(log_probs, labels, axis=-1, batch_dims=2) + eps * -tf.reduce_mean(
            log_probs, axis=-1
        )
        reference = tf.reduce_sum(per_token * mask) / tf.reduce_sum(mask)
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


@pytest.mark.parametrize("weights", ["per_sentence", "per_token"])
def test_loss_with_sample_weight_is_the_weighted_mean_over_real_tokens(weights):
    labels, logits = _padded_batch(2)
    if weights == "per_sentence":
        sample_weight = np.array([0.5, 2.0, 3.0])
        w = np.broadcast_to(sample_weight[:, None], labels.shape)
    else:
        sample_weight = w = np.linspace(0.1, 3.0, 15).reshape(3, 5)
    l, m = _reference_per_token(labels, logits, 0.1), labels != 0
    expected = (w * l * m).sum() / (w * m).sum()
    loss = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)
    assert float(loss(labels, logits, sample_weight=sample_weight)) == pytest.approx(expected, rel=1e-5)
    # Weights 1 are no weights.
    unweighted = _reference(labels, logits, 0.1)
    assert float(loss(labels, logits, sample_weight=np.ones(3))) == pytest.approx(unweighted, rel=1e-5)


def test_loss_reductions_sum_and_none_follow_the_formula():
    labels, logits = _padded_batch(3)
    l, m = _reference_per_token(labels, logits, 0.1), labels != 0
    summed = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1, reduction="sum")
    assert float(summed(labels, logits)) == pytest.approx((l * m).sum(), rel=1e-5)
    w = np.array([0.5, 2.0, 3.0])
    assert float(summed(labels, logits, sample_weight=w)) == pytest.approx((w[:, None] * l * m).sum(), rel=1e-5)
    per_token = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1, reduction=None)(labels, logits)
    np.testing.assert_allclose(per_token.numpy(), l * m, rtol=1e-5, atol=1e-6)


def test_masked_accuracy_counts_a_tie_as_a_miss():
    metric = kt.MaskedAccuracy()
    labels = np.array([[1, 2, 3, 0]])
    logits = np.zeros((1, 4, 6), "float32")  # constant logits: nothing is predicted
    metric.update_state(labels, logits)
    assert float(metric.result()) == 0.0
    logits[0, 0, 1] = 1.0  # the reference alone on top: a hit
    logits[0, 1, [2, 4]] = 1.0  # the reference tied with another: a miss
    metric.update_state(labels, logits)
    assert float(metric.result()) == pytest.approx(1 / 6)


def test_masked_accuracy_weights_hits_and_real_tokens_by_sample_weight():
    rng = np.random.default_rng(4)
    labels = rng.integers(1, 5, size=(4, 6))
    labels[1, 2:] = 0
    labels[3, 4:] = 0
    logits = rng.normal(size=(4, 6, 5)).astype("float32")
    logits[..., 0] = -10.0
    sample_weight = np.array([1.0, 4.0, 0.0, 2.5])
    metric = kt.MaskedAccuracy()
    metric.update_state(labels, logits, sample_weight=sample_weight)
    hits, real, w = logits.argmax(-1) == labels, labels != 0, sample_weight[:, None]
    expected = (w * hits * real).sum() / (w * real).sum()
    assert expected != pytest.approx((hits * real).sum() / real.sum())  # the weights matter here
    assert float(metric.result()) == pytest.approx(expected, rel=1e-6)


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
weights = np.array([0.5, 3.0])
for loss in (kt.MaskedSparseCategoricalCrossentropy(), kt.MaskedSparseCategoricalCrossentropy(reduction="sum")):
    for sample_weight in (None, weights):
        alone = float(loss(labels, logits, sample_weight=sample_weight))
        with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
            per_replica = tf.distribute.get_strategy().run(lambda: loss(labels, logits, sample_weight=sample_weight))
        print(alone, float(per_replica.values[0]), float(per_replica.values[1]))
"""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [list(map(float, line.split())) for line in done.stdout.strip().splitlines()[-4:]]
    # The mean, with and without sample weights, carries 1/N; a sum is already the global sum's share.
    for (alone, first, second), replicas in zip(lines, [2, 2, 1, 1], strict=True):
        assert first == pytest.approx(alone / replicas, rel=1e-6)
        assert second == pytest.approx(alone / replicas, rel=1e-6)
