"""The label-smoothed loss and token accuracy ignore padding and follow their formulas."""

import json
import warnings
import zipfile

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


def _log_softmax(logits):
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _r_drop_reference(labels, logits, eps, kl_weight):
    """R-Drop's loss from the paper's definitions: for each pair of rows (2i, 2i + 1) and real token,
    CE(P) + CE(Q) + kl_weight / 2 (KL(P || Q) + KL(Q || P)) (the paper's alpha), with each KL written as
    sum p (log p - log q); averaged over the real tokens of both rows."""
    ce = _reference_per_token(labels, logits, eps)
    log_p, log_q = _log_softmax(logits[0::2]), _log_softmax(logits[1::2])
    kl_pq = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    kl_qp = (np.exp(log_q) * (log_q - log_p)).sum(-1)
    per_pair = ce[0::2] + ce[1::2] + kl_weight / 2 * (kl_pq + kl_qp)
    real = labels[0::2] != 0
    return per_pair[real].sum() / (2 * real.sum())


def _paired_batch(seed, pairs=3, length=5, vocab=9):
    """Labels with padding, each row twice in a row, and logits that differ between the two rows of a pair."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(1, vocab, size=(pairs, length))
    labels[0, 3:] = 0
    labels[-1, 1:] = 0
    return np.repeat(labels, 2, axis=0), rng.normal(size=(2 * pairs, length, vocab)).astype("float32") * 3


@pytest.mark.parametrize("kl_weight", [0.0, 0.7, 5.0])
def test_r_drop_loss_is_both_passes_cross_entropy_plus_kl_weight_times_their_symmetric_kl(kl_weight):
    labels, logits = _paired_batch(5)
    loss = kt.MaskedRDropCrossentropy(kl_weight=kl_weight, label_smoothing=0.1)
    expected = _r_drop_reference(labels, logits, 0.1, kl_weight)
    assert float(loss(labels, logits)) == pytest.approx(expected, rel=1e-5)
    if kl_weight:
        # The KL term is there: the plain loss of the same rows is lower.
        assert expected > _reference(labels, logits, 0.1) + 0.01
    # Padding is ignored: whatever the logits there, the loss is the same.
    logits[0:2, 3:] = 50.0 * np.arange(9)
    assert float(loss(labels, logits)) == pytest.approx(expected, rel=1e-5)


def test_r_drop_loss_of_agreeing_passes_is_the_plain_loss():
    # Two identical predictions (dropout off: evaluation) have no KL; the loss is the label-smoothed one.
    labels, logits = _paired_batch(6)
    logits[1::2] = logits[0::2]
    plain = float(kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)(labels, logits))
    assert float(kt.MaskedRDropCrossentropy(kl_weight=5.0, label_smoothing=0.1)(labels, logits)) == pytest.approx(
        plain, rel=1e-6)


def test_r_drop_loss_sees_no_divergence_between_logits_a_constant_apart():
    # Logits that differ by a constant per position are the same distribution: KL 0, the plain loss.
    labels, logits = _paired_batch(7)
    logits[1::2] = logits[0::2] + np.random.default_rng(7).normal(size=(3, 5, 1)).astype("float32") * 4
    plain = float(kt.MaskedSparseCategoricalCrossentropy(label_smoothing=0.1)(labels, logits))
    assert float(kt.MaskedRDropCrossentropy(kl_weight=5.0, label_smoothing=0.1)(labels, logits)) == pytest.approx(
        plain, rel=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_r_drop_loss_gradient_is_that_of_the_textbook_formula(weighted):
    # Weighted: the two rows of a pair weigh differently, so each row's KL gradient needs both rows' upstream.
    labels, logits = _paired_batch(8)
    weights = np.random.default_rng(8).uniform(0.2, 2.0, size=labels.shape).astype("float32") if weighted else None
    token_weights = ops.convert_to_tensor((labels != 0) * (1.0 if weights is None else weights), "float32")

    def reference_loss(logits):
        log_probs = ops.log_softmax(logits)
        log_p_y = ops.take_along_axis(log_probs, ops.convert_to_tensor(labels[..., None]), axis=-1)[..., 0]
        ce = 0.9 * -log_p_y + 0.1 * -ops.mean(log_probs, axis=-1)
        log_p, log_q = log_probs[0::2], log_probs[1::2]
        kl = ops.sum(ops.exp(log_p) * (log_p - log_q) + ops.exp(log_q) * (log_q - log_p), axis=-1)
        per_row = ce + 5.0 / 4.0 * ops.repeat(kl, 2, axis=0)
        return ops.sum(per_row * token_weights) / ops.sum(token_weights)

    loss = kt.MaskedRDropCrossentropy(kl_weight=5.0, label_smoothing=0.1)
    ours, (grad,) = gradients(lambda logits: loss(labels, logits, sample_weight=weights), [logits])
    reference, (reference_grad,) = gradients(reference_loss, [logits])
    np.testing.assert_allclose(float(ours), float(reference), rtol=1e-5)
    np.testing.assert_allclose(grad, reference_grad, atol=1e-6)
    assert (grad[0:2, 3:] == 0).all()  # padding gets no gradient


def test_r_drop_loss_refuses_an_odd_batch_and_a_negative_kl_weight():
    labels, logits = _paired_batch(9)
    with pytest.raises(ValueError, match="each sentence twice in a row"):
        kt.MaskedRDropCrossentropy()(labels[:5], logits[:5])
    with pytest.raises(ValueError, match="kl_weight must be 0 or more"):
        kt.MaskedRDropCrossentropy(kl_weight=-1.0)


def test_r_drop_loss_takes_its_old_alpha_argument_as_kl_weight_with_a_deprecation_warning():
    labels, logits = _paired_batch(10)
    with pytest.warns(DeprecationWarning, match=r"alpha=\.\.\.\) is now MaskedRDropCrossentropy\(kl_weight="):
        old = kt.MaskedRDropCrossentropy(alpha=2.0, label_smoothing=0.1)
    assert old.kl_weight == 2.0 and "alpha" not in old.get_config()
    assert float(old(labels, logits)) == pytest.approx(_r_drop_reference(labels, logits, 0.1, 2.0), rel=1e-5)
    with pytest.raises(ValueError, match="alpha is kl_weight's old name, give kl_weight only"):
        kt.MaskedRDropCrossentropy(kl_weight=1.0, alpha=2.0)
    # Both names are refused whatever the values, the default's value too (kl_weight=5.0 is its default).
    with pytest.raises(ValueError, match="got kl_weight=5.0 and alpha=2: alpha is kl_weight's old name"):
        kt.MaskedRDropCrossentropy(kl_weight=5.0, alpha=2)


def test_r_drop_loss_loads_a_config_saved_with_alpha():
    # What a loss serialized before the rename holds: "alpha", not "kl_weight".
    new = kt.MaskedRDropCrossentropy(kl_weight=2.5, label_smoothing=0.2).get_config()
    old = {**{k: v for k, v in new.items() if k != "kl_weight"}, "alpha": 2.5}
    serialized = keras.saving.serialize_keras_object(kt.MaskedRDropCrossentropy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a saved file is not the caller's to fix: no deprecation warning
        loaded = keras.saving.deserialize_keras_object({**serialized, "config": old})
    assert type(loaded) is kt.MaskedRDropCrossentropy
    assert (loaded.kl_weight, loaded.label_smoothing) == (2.5, 0.2)
    assert loaded.get_config() == new  # saved again, it writes kl_weight
    labels, logits = _paired_batch(11)
    assert float(loaded(labels, logits)) == pytest.approx(_r_drop_reference(labels, logits, 0.2, 2.5), rel=1e-5)


def _rename_loss_key(keras_file, old, new):
    """Rewrites a .keras file's compiled loss config with its key `old` renamed `new`."""
    with zipfile.ZipFile(keras_file) as z:
        members = {name: z.read(name) for name in z.namelist()}
    config = json.loads(members["config.json"])
    loss = config["compile_config"]["loss"]["config"]
    loss[new] = loss.pop(old)
    members["config.json"] = json.dumps(config).encode()
    with zipfile.ZipFile(keras_file, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def test_a_model_compiled_with_the_r_drop_loss_round_trips_through_a_keras_file_old_or_new(tmp_path):
    model = kt.Transformer.from_preset("tiny", vocab_size=9, dropout=0.0)
    model.compile(optimizer="adam", loss=kt.MaskedRDropCrossentropy(kl_weight=2.5, label_smoothing=0.2))
    labels, _ = _paired_batch(12)
    inputs = (labels, labels)
    expected = float(to_numpy(model.loss(labels, model(inputs))))
    model.optimizer.build(model.trainable_variables)  # saved with its variables, as after training
    path = tmp_path / "model.keras"
    model.save(path)
    old_path = tmp_path / "old.keras"
    old_path.write_bytes(path.read_bytes())
    _rename_loss_key(old_path, "kl_weight", "alpha")  # as the file was written before the rename
    for file in (path, old_path):
        loaded = keras.models.load_model(file)
        assert type(loaded.loss) is kt.MaskedRDropCrossentropy, file.name
        assert (loaded.loss.kl_weight, loaded.loss.label_smoothing) == (2.5, 0.2), file.name
        assert float(to_numpy(loaded.loss(labels, loaded(inputs)))) == pytest.approx(expected, rel=1e-5)
