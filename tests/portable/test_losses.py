"""The label-smoothed loss and token accuracy ignore padding and follow their formulas."""

import keras
import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from portable.conftest import gradients, to_numpy


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
    rng = np.random.default_rng(1)
    labels = rng.integers(1, 9, size=(3, 5))
    labels[1, 2:] = 0
    logits = rng.normal(size=(3, 5, 9)).astype("float32") * 30  # large: no overflow either
    mask = ops.convert_to_tensor(labels != 0, "float32")

    def reference_loss(logits):
        log_probs = ops.log_softmax(logits)
        log_p_y = ops.take_along_axis(log_probs, ops.convert_to_tensor(labels[..., None]), axis=-1)[..., 0]
        per_token = (1 - eps) * -log_p_y + eps * -ops.mean(log_probs, axis=-1)
        return ops.sum(per_token * mask) / ops.sum(mask)

    loss = kt.MaskedSparseCategoricalCrossentropy(label_smoothing=eps)
    ours, (grad,) = gradients(lambda logits: loss(labels, logits), [logits])
    reference, (reference_grad,) = gradients(reference_loss, [logits])
    np.testing.assert_allclose(float(ours), float(reference), rtol=1e-5)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad, reference_grad, atol=1e-6)
    assert (grad[1, 2:] == 0).all()  # padding gets no gradient


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
    np.testing.assert_allclose(to_numpy(per_token), l * m, rtol=1e-5, atol=1e-6)


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
