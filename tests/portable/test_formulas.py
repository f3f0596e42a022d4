"""The positional encoding, the learning-rate schedule and the model size, against the paper."""

import math
import re

import numpy as np
import pytest

import keras_transformer as kt
from portable.conftest import to_numpy


@pytest.mark.parametrize("pos", [0, 1, 7, 50, 311])
@pytest.mark.parametrize("i", [0, 1, 5, 127, 255])
def test_positional_encoding_formula(pos, i):
    d_model = 512
    table = to_numpy(kt.positional_encoding(np.arange(400), d_model))
    angle = pos / 10000 ** (2 * i / d_model)
    assert table[pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
    assert table[pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)


def test_the_halves_layout_holds_the_same_sinusoids_every_sin_then_every_cos():
    """Marian's layout: column i is the sin of frequency i, column d_model/2 + i its cos."""
    d_model = 512
    table = to_numpy(kt.positional_encoding(np.arange(400), d_model, layout="halves"))
    for pos in (0, 1, 50, 311):
        for i in (0, 5, 255):
            angle = pos / 10000 ** (2 * i / d_model)
            assert table[pos, i] == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, d_model // 2 + i] == pytest.approx(math.cos(angle), abs=1e-5)
    embedding = kt.PositionalEmbedding(vocab_size=10, d_model=8, sinusoid_layout="halves")
    ids = np.array([[3, 4, 0]])
    expected = (to_numpy(embedding.token_embedding(ids))[0] * math.sqrt(8)
                + to_numpy(kt.positional_encoding(np.arange(3), 8, layout="halves")))
    np.testing.assert_allclose(to_numpy(embedding(ids))[0], expected, atol=1e-5)
    with pytest.raises(ValueError, match="PositionalEmbedding: sinusoid_layout must be one of 'interleaved', "
                                         "'halves', got 'cos-first'"):
        kt.PositionalEmbedding(vocab_size=10, d_model=8, sinusoid_layout="cos-first")


def test_embedding_is_scaled_tokens_plus_encoding():
    layer = kt.PositionalEmbedding(vocab_size=10, d_model=8)
    ids = np.array([[3, 4, 5, 0]])
    out = to_numpy(layer(ids))
    table = layer.token_embedding.embeddings.numpy()
    expected = table[ids[0]] * math.sqrt(8) + to_numpy(kt.positional_encoding(np.arange(4), 8))
    np.testing.assert_allclose(out[0], expected, atol=1e-5)
    np.testing.assert_array_equal(to_numpy(layer.compute_mask(ids)), ids != 0)
    # Decoding one step at position 2 sees the same encoding as the full pass.
    np.testing.assert_allclose(to_numpy(layer(ids[:, 2:3], start_index=2))[0, 0], out[0, 2], atol=1e-5)


@pytest.mark.parametrize("activation,f", [
    ("relu", lambda h: np.maximum(h, 0.0)),  # the paper's equation 2
    ("silu", lambda h: h / (1.0 + np.exp(-h))),  # Marian's swish: x * sigmoid(x)
    ("swish", lambda h: h / (1.0 + np.exp(-h))),
])
def test_the_feed_forward_network_is_f_of_x_w1_plus_b1_times_w2_plus_b2(activation, f):
    """FFN(x) = f(x W_1 + b_1) W_2 + b_2 at every position, from the layer's own weights (biases made nonzero)."""
    rng = np.random.default_rng(3)
    layer = kt.FeedForward(d_model=8, d_ff=16, activation=activation)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    layer.build(x.shape)
    for dense in (layer.inner, layer.outer):
        dense.bias.assign(rng.normal(size=dense.bias.shape).astype("float32"))
    w1, b1, w2, b2 = (to_numpy(w) for w in (layer.inner.kernel, layer.inner.bias, layer.outer.kernel,
                                             layer.outer.bias))
    np.testing.assert_allclose(to_numpy(layer(x)), f(x @ w1 + b1) @ w2 + b2, rtol=1e-5, atol=1e-5)


def test_an_unknown_activation_or_an_epsilon_not_above_0_is_refused_naming_the_value():
    for activation in ("not_an_activation", None, 3):
        with pytest.raises(ValueError, match=r"activation must be the name of a Keras activation .* got " +
                           re.escape(repr(activation))):
            kt.Transformer.from_preset("tiny", vocab_size=10, activation=activation)
    for epsilon in (0, -1e-5, "1e-5", True):
        with pytest.raises(ValueError, match=r"Encoder: layer_norm_epsilon must be a number > 0, got " +
                           re.escape(repr(epsilon))):
            kt.Transformer.from_preset("tiny", vocab_size=10, layer_norm_epsilon=epsilon)


def test_the_output_bias_is_added_to_the_tied_projections_logits():
    """output_bias=True: logits = x E^T + b, E the target embedding and b the model's `output_bias` weight;
    an untied projection (a Dense with its own bias) refuses the option."""
    model = kt.Transformer.from_preset("tiny", vocab_size=12, output_bias=True)
    model.build()
    rng = np.random.default_rng(7)
    bias = rng.normal(size=(12,)).astype("float32")
    model.logits_bias.assign(bias)
    x = rng.normal(size=(2, 3, 32)).astype("float32")
    embeddings = to_numpy(model.target_embedding.token_embedding.embeddings)
    np.testing.assert_allclose(to_numpy(model.project(x)), x @ embeddings.T + bias, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"output_bias=True\) adds a bias to the tied output projection"):
        kt.Transformer.from_preset("tiny", vocab_size=12, output_bias=True, tie_output_embedding=False)


def test_learned_positions_add_a_table():
    layer = kt.PositionalEmbedding(vocab_size=10, d_model=8, learned_positions=True, max_positions=16)
    ids = np.array([[3, 4, 5]])
    out = to_numpy(layer(ids))
    tokens = layer.token_embedding.embeddings.numpy()[ids[0]] * math.sqrt(8)
    positions = layer.position_embedding.embeddings.numpy()[:3]
    np.testing.assert_allclose(out[0], tokens + positions, atol=1e-5)


@pytest.mark.parametrize("step", [1, 10, 1000, 3999, 4000, 4001, 10000, 100000])
@pytest.mark.parametrize("d_model,warmup", [(512, 4000), (256, 1000)])
def test_schedule_formula(step, d_model, warmup):
    schedule = kt.TransformerSchedule(d_model, warmup_steps=warmup)
    expected = d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)
    assert float(schedule(step)) == pytest.approx(expected, rel=1e-5)


def test_schedule_peaks_at_warmup_and_round_trips():
    schedule = kt.TransformerSchedule(512)
    rates = [float(schedule(s)) for s in (3000, 4000, 5000)]
    assert rates[1] > rates[0] and rates[1] > rates[2]
    assert float(schedule(0)) == 0.0
    again = kt.TransformerSchedule.from_config(schedule.get_config())
    assert float(again(1234)) == float(schedule(1234))


def test_paper_adam_settings():
    optimizer = kt.paper_adam(512, warmup_steps=100)
    assert (optimizer.beta_1, optimizer.beta_2, optimizer.epsilon) == (0.9, 0.98, 1e-9)
    schedule = optimizer.get_config()["learning_rate"]
    assert schedule["class_name"] == "TransformerSchedule"
    assert schedule["config"] == {"d_model": 512, "warmup_steps": 100, "scale": 1.0}


@pytest.mark.parametrize("scale", [0.5, 2.5])
def test_schedule_scale_multiplies_the_papers_rate(scale):
    """OpenNMT-tf's NoamDecay: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); its peak, at the end of
    warm-up, is scale * (d_model * warmup)^-0.5."""
    scaled, paper = kt.TransformerSchedule(128, 2000, scale=scale), kt.TransformerSchedule(128, 2000)
    for step in (1, 500, 2000, 9000):
        assert float(scaled(step)) == pytest.approx(scale * float(paper(step)), rel=1e-6)
    assert float(scaled(2000)) == pytest.approx(scale * (128 * 2000) ** -0.5, rel=1e-5)
    assert kt.TransformerSchedule.from_config(scaled.get_config()).scale == scale
    with pytest.raises(ValueError, match="scale must be positive"):
        kt.TransformerSchedule(128, 2000, scale=0)


def test_base_model_has_the_papers_parameter_count():
    """Base with a shared 37,000-token vocabulary: the paper's "65M" (table 3).

    Counted from the paper's definitions: one shared embedding matrix (also the
    output projection, section 3.4); per attention 4 d_model x d_model
    projections with biases; per FFN d_model x d_ff and d_ff x d_model with
    biases; two LayerNorm vectors per residual block. The exact figure is
    63,082,496, the count usually quoted as ~63M-65M.
    """
    d_model, d_ff, vocab, n = 512, 2048, 37000, 6
    attention = 4 * (d_model * d_model + d_model)
    ffn = d_model * d_ff + d_ff + d_ff * d_model + d_model
    norm = 2 * d_model
    expected = vocab * d_model + n * (attention + ffn + 2 * norm) + n * (2 * attention + ffn + 3 * norm)
    assert expected == 63_082_496
    model = kt.Transformer.from_preset("base", vocab_size=vocab)
    model.build()
    assert model.count_params() == 63_082_496
