"""Attention dropout and activation dropout (fairseq's names; not in the paper): each reaches every layer, acts in
training only, and changes nothing at inference."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from conftest import VOCAB, random_ids
from portable.conftest import to_numpy

RATES = ("attention_dropout", "activation_dropout")


def _model(**rates):
    """The tiny preset with residual and embedding dropout off, so that only `rates` can make training differ."""
    model = kt.Transformer.from_preset("tiny", vocab_size=VOCAB, dropout=0.0, **rates)
    model.build()
    return model


@pytest.mark.parametrize("rate", RATES)
def test_each_rate_reaches_every_attention_or_feed_forward(rate):
    model = _model(**{rate: 0.3})
    layers = [*model.encoder.encoder_layers, *model.decoder.decoder_layers]
    if rate == "attention_dropout":
        attentions = [a for layer in layers for a in (layer.self_attention, getattr(layer, "cross_attention", None)) if a]
        assert len(attentions) == 6 and all(a._dropout == 0.3 for a in attentions)
    else:
        assert all(layer.feed_forward.dropout == 0.3 for layer in layers)
    assert all(getattr(layer, rate) == 0.3 for layer in layers)


@pytest.mark.parametrize("rate", RATES)
def test_each_rate_acts_in_training_only(rate):
    rng = np.random.default_rng(0)
    source, target = random_ids(rng, 3, 7), random_ids(rng, 3, 5)
    model, plain = _model(**{rate: 0.5}), _model()
    plain.set_weights(model.get_weights())
    inference = to_numpy(model((source, target), training=False))
    np.testing.assert_allclose(inference, to_numpy(plain((source, target), training=False)), atol=1e-6)
    # The plain model has no dropout left: training and inference agree there, so a difference is the rate's.
    np.testing.assert_allclose(to_numpy(plain((source, target), training=True)), inference, atol=1e-6)
    assert not np.allclose(to_numpy(model((source, target), training=True)), inference, atol=1e-4)


@pytest.mark.parametrize("rate", RATES)
def test_the_rates_round_trip_through_a_keras_file(tmp_path, rate):
    model = _model(**{rate: 0.25})
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras", compile=False)
    assert getattr(loaded, rate) == 0.25
    assert all(getattr(layer, rate) == 0.25 for layer in loaded.decoder.decoder_layers)


@pytest.mark.parametrize("rate", ("dropout", *RATES))
@pytest.mark.parametrize("value", (-0.1, 1.0))
def test_a_rate_outside_0_1_is_refused_by_name(rate, value):
    with pytest.raises(ValueError, match=f"{rate} must be in \\[0, 1\\)"):
        kt.EncoderLayer(16, 2, 32, **{rate: value})
