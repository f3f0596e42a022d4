"""Attention weights, checked against their definition: softmax rows over the
keys a query may see (paper sections 3.2.1 and 3.2.3)."""

import numpy as np
import pytest

import keras_transformer as kt
from conftest import random_ids
from portable.conftest import to_numpy


def _batch(rng):
    """Source and target ids with padding in both, rows of different lengths."""
    source = random_ids(rng, 3, 7)
    source[0, 4:] = 0
    source[2, 6:] = 0
    target = random_ids(rng, 3, 6)
    target[1, 3:] = 0
    return source, target


@pytest.fixture
def scores(tiny_model):
    source, target = _batch(np.random.default_rng(0))
    weights = tiny_model.attention_scores(source, target)
    return source, target, {name: [to_numpy(w) for w in layers] for name, layers in weights.items()}


def test_one_tensor_per_layer_with_heads_queries_keys(tiny_model, scores):
    source, target, weights = scores
    heads = tiny_model.num_heads
    expected = {
        "encoder_self_attention": (tiny_model.num_encoder_layers, (3, heads, 7, 7)),
        "decoder_self_attention": (tiny_model.num_decoder_layers, (3, heads, 6, 6)),
        "decoder_cross_attention": (tiny_model.num_decoder_layers, (3, heads, 6, 7)),
    }
    assert set(weights) == set(expected)
    for name, (layers, shape) in expected.items():
        assert len(weights[name]) == layers, name
        for w in weights[name]:
            assert w.shape == shape and w.dtype == np.float32, name


def test_rows_sum_to_one_at_real_queries(scores):
    source, target, weights = scores
    real_query = {"encoder_self_attention": source != 0}
    real_query["decoder_self_attention"] = real_query["decoder_cross_attention"] = target != 0
    for name, layers in weights.items():
        for w in layers:
            sums = w.sum(axis=-1)  # [batch, heads, queries]
            rows = np.broadcast_to(real_query[name][:, None, :], sums.shape)
            np.testing.assert_allclose(sums[rows], 1.0, atol=1e-5, err_msg=name)


def test_source_padding_gets_no_weight(scores):
    source, target, weights = scores
    real_key = (source != 0)[:, None, None, :]  # [batch, 1, 1, source_len]
    real_query = {"encoder_self_attention": source != 0, "decoder_cross_attention": target != 0}
    for name, queries in real_query.items():
        for w in weights[name]:
            assert np.all(w[np.broadcast_to(~real_key, w.shape)] == 0.0), name
            # And a real query spreads its softmax over every real key.
            seen = np.broadcast_to(real_key & queries[:, None, :, None], w.shape)
            assert np.all(w[seen] > 0.0), name


def test_decoder_self_attention_is_causal(scores):
    source, target, weights = scores
    future = np.triu(np.ones((6, 6), bool), k=1)  # key position > query position
    for w in weights["decoder_self_attention"]:
        assert np.all(w[:, :, future] == 0.0)
        # Target padding is a key no real query reads either.
        pad_key = np.broadcast_to((target == 0)[:, None, None, :], w.shape)
        assert np.all(w[pad_key] == 0.0)


def test_layers_return_the_same_output_with_scores(tiny_model):
    rng = np.random.default_rng(1)
    source, target = _batch(rng)
    source_mask, target_mask = kt.padding_mask(source), kt.padding_mask(target)
    # As arrays: no Keras masks attached, which keras.layers.MultiHeadAttention
    # would read (and then delete) on the first call only.
    x = to_numpy(tiny_model.target_embedding(target))
    memory = to_numpy(tiny_model.encode(source))

    encoder_layer = tiny_model.encoder.encoder_layers[0]
    plain = encoder_layer(memory, padding_mask=source_mask)
    out, weights = encoder_layer(memory, padding_mask=source_mask, return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(out), to_numpy(plain), atol=1e-5)
    assert weights.shape == (3, tiny_model.num_heads, 7, 7)

    decoder_layer = tiny_model.decoder.decoder_layers[0]
    masks = dict(encoder_padding_mask=source_mask, decoder_padding_mask=target_mask)
    plain = decoder_layer(x, memory, **masks)
    out, weights = decoder_layer(x, memory, return_attention_scores=True, **masks)
    np.testing.assert_allclose(to_numpy(out), to_numpy(plain), atol=1e-5)
    assert sorted(weights) == ["cross_attention", "self_attention"]
    assert weights["self_attention"].shape == (3, tiny_model.num_heads, 6, 6)
    assert weights["cross_attention"].shape == (3, tiny_model.num_heads, 6, 7)

    # And the stacks: the pass that collects the weights is the model's forward
    # pass, at every real position. (Padding positions may differ: a query row
    # the Keras mask hides entirely comes out as zeros from the explicit softmax
    # that returns weights, as an average from the fused kernel; nothing reads it.)
    real_source, real_target = source != 0, target != 0
    memory_with_scores, _ = tiny_model.encoder(
        tiny_model.target_embedding(source), padding_mask=source_mask, return_attention_scores=True
    )
    np.testing.assert_allclose(to_numpy(memory_with_scores)[real_source], memory[real_source], atol=1e-5)
    hidden, _ = tiny_model.decoder(tiny_model.target_embedding(target), memory, return_attention_scores=True, **masks)
    logits = to_numpy(tiny_model((source, target)))
    np.testing.assert_allclose(to_numpy(tiny_model.project(hidden))[real_target], logits[real_target], atol=1e-4)


def test_decoding_cache_refuses_scores(tiny_model):
    layer = tiny_model.decoder.decoder_layers[0]
    x = np.zeros((1, 1, tiny_model.d_model), "float32")
    with pytest.raises(ValueError, match="full pass only"):
        layer(x, x, self_attention_cache=layer.self_attention.empty_cache(1, 4), cache_index=0,
              return_attention_scores=True)


def test_functional_api_gets_the_weights_as_a_second_output():
    import keras

    source = keras.Input(shape=(None,), dtype="int32")
    target = keras.Input(shape=(None,), dtype="int32")
    embedding = kt.PositionalEmbedding(40, 32)
    memory, encoder_weights = kt.Encoder(2, 32, 4, 64)(embedding(source), return_attention_scores=True)
    _, decoder_weights = kt.DecoderLayer(32, 4, 64)(embedding(target), memory, return_attention_scores=True)
    model = keras.Model((source, target), (encoder_weights, decoder_weights))

    rng = np.random.default_rng(2)
    (first, second), weights = model((random_ids(rng, 2, 5), random_ids(rng, 2, 3)))
    assert first.shape == second.shape == (2, 4, 5, 5)
    assert weights["self_attention"].shape == (2, 4, 3, 3) and weights["cross_attention"].shape == (2, 4, 3, 5)
    np.testing.assert_allclose(to_numpy(weights["cross_attention"]).sum(axis=-1), 1.0, atol=1e-5)
