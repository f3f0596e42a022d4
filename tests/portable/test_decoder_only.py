"""A decoder-only (GPT-style) model from the library's layers: no cross-attention, the cache, generation.

(greedy_generate's tests: test_generate.py.)"""

import math

import keras
import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from conftest import PATTERN_LENGTH, PATTERN_VOCAB, VOCAB, gpt_layers, gpt_model, random_ids
from portable.conftest import to_numpy

D_MODEL, HEADS, D_FF = 16, 2, 32


def _self_attention_and_ffn_params(d, d_ff):
    """Self-attention (W^Q, W^K, W^V, W^O with biases), the FFN, and two LayerNorms (scale and offset)."""
    return 4 * (d * d + d) + (d * d_ff + d_ff + d_ff * d + d) + 2 * 2 * d


# ---------------------------------------------------------------------------------------------------------------
# No cross-attention: its weights, its errors, its config


def test_decoder_layer_without_cross_attention_has_no_cross_attention_weights():
    x = np.zeros((2, 3, D_MODEL), "float32")
    layer = kt.DecoderLayer(D_MODEL, HEADS, D_FF, use_cross_attention=False)
    assert layer(x).shape == x.shape
    assert layer.count_params() == _self_attention_and_ffn_params(D_MODEL, D_FF)
    assert not [w.path for w in layer.weights if "cross_attention" in w.path]
    # The paper's layer has one more attention block and one more LayerNorm.
    paper = kt.DecoderLayer(D_MODEL, HEADS, D_FF)
    paper(x, x)
    assert paper.count_params() == layer.count_params() + 4 * (D_MODEL * D_MODEL + D_MODEL) + 2 * D_MODEL
    # A pre-norm stack adds its final LayerNorm.
    stack = kt.Decoder(3, D_MODEL, HEADS, D_FF, norm_first=True, use_cross_attention=False)
    stack.build((None, None, D_MODEL))
    assert stack.count_params() == 3 * _self_attention_and_ffn_params(D_MODEL, D_FF) + 2 * D_MODEL


X = np.zeros((1, 3, D_MODEL), "float32")
MEMORY = np.zeros((1, 4, D_MODEL), "float32")
ONLY = dict(use_cross_attention=False)


def _symbolic():
    return keras.Input((None, D_MODEL))


@pytest.mark.parametrize(
    "call,argument",
    [
        (lambda: kt.DecoderLayer(D_MODEL, HEADS, D_FF, **ONLY)(X, MEMORY), "encoder_output"),
        (lambda: kt.DecoderLayer(D_MODEL, HEADS, D_FF, **ONLY)(X, encoder_padding_mask=np.ones((1, 4), bool)),
         "encoder_padding_mask"),
        (lambda: kt.DecoderLayer(D_MODEL, HEADS, D_FF)(X), "encoder_output"),
        (lambda: kt.Decoder(1, D_MODEL, HEADS, D_FF, **ONLY)(X, MEMORY), "encoder_output"),
        (lambda: kt.Decoder(1, D_MODEL, HEADS, D_FF)(X), "encoder_output"),
        (lambda: kt.Decoder(1, D_MODEL, HEADS, D_FF, **ONLY)(_symbolic(), _symbolic()), "encoder_output"),
        (lambda: kt.Decoder(1, D_MODEL, HEADS, D_FF)(_symbolic()), "encoder_output"),
        (lambda: kt.Decoder(1, D_MODEL, HEADS, D_FF, **ONLY).compute_cross_attention_cache(MEMORY),
         "use_cross_attention=False"),
    ],
    ids=["layer-extra", "layer-extra-mask", "layer-missing", "stack-extra", "stack-missing", "functional-extra",
         "functional-missing", "cross-cache"],
)
def test_encoder_inputs_that_do_not_match_use_cross_attention_raise_a_clear_error(call, argument):
    with pytest.raises(ValueError, match=argument):
        call()


@pytest.mark.parametrize("cls,kwargs", [(kt.DecoderLayer, {}), (kt.Decoder, dict(num_layers=2, norm_first=True))])
def test_config_round_trips_and_a_config_from_before_the_option_means_cross_attention(cls, kwargs):
    kwargs = dict(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, **kwargs)
    only = cls(**kwargs, use_cross_attention=False)
    config = only.get_config()
    assert config["use_cross_attention"] is False
    again = keras.saving.deserialize_keras_object(keras.saving.serialize_keras_object(only))
    assert again.get_config() == config

    paper = cls(**kwargs)
    old_config = paper.get_config()
    del old_config["use_cross_attention"]  # what get_config returned before the option existed
    old = cls.from_config(old_config)
    assert old.use_cross_attention is True
    for layer in (paper, old):
        layer.build((None, None, D_MODEL), (None, None, D_MODEL))
    assert [w.path for w in old.weights] == [w.path for w in paper.weights]
    assert old.count_params() == paper.count_params()


# ---------------------------------------------------------------------------------------------------------------
# The paper's definitions, without an encoder


def test_decoder_only_model_is_causal():
    model = gpt_model()
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 2, 8)
    logits = to_numpy(model(ids))
    for t in range(ids.shape[1] - 1):
        changed = ids.copy()
        changed[:, t + 1 :] = random_ids(rng, 2, ids.shape[1] - t - 1)
        assert (changed[:, t + 1 :] != ids[:, t + 1 :]).any()
        new_logits = to_numpy(model(changed))
        np.testing.assert_allclose(new_logits[:, : t + 1], logits[:, : t + 1], atol=1e-5)
        # And the change is seen where it may be: the next position moves.
        assert np.abs(new_logits[:, t + 1] - logits[:, t + 1]).max() > 1e-4


def test_right_padding_changes_nothing_at_real_positions():
    rng = np.random.default_rng(1)
    ids = random_ids(rng, 3, 6)
    ids[1, 4:] = 0  # rows of different lengths in one batch
    padded = np.pad(ids, [(0, 0), (0, 5)])
    real = ids != 0

    # The layers with the explicit decoder_padding_mask (what a tf.function or a model boundary keeps).
    embedding = kt.PositionalEmbedding(VOCAB, D_MODEL)
    decoder = kt.Decoder(2, D_MODEL, HEADS, D_FF, dropout=0.0, use_cross_attention=False)

    def hidden(token_ids):
        x = ops.copy(embedding(token_ids))  # a new tensor: no Keras mask to fall back on
        return to_numpy(decoder(x, decoder_padding_mask=kt.padding_mask(token_ids)))

    np.testing.assert_allclose(hidden(padded)[:, :6][real], hidden(ids)[real], atol=1e-5)

    # The functional model, where only the Keras mask PositionalEmbedding attaches carries the padding.
    model = gpt_model()
    np.testing.assert_allclose(to_numpy(model(padded))[:, :6][real], to_numpy(model(ids))[real], atol=1e-5)


def test_a_key_the_padding_mask_marks_is_never_attended():
    """Right padding is invisible to a causal decoder anyway; a masked key before real ones shows the mask is used."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 6, D_MODEL)).astype("float32")
    mask = np.ones((2, 6), bool)
    mask[:, 2] = False
    decoder = kt.Decoder(2, D_MODEL, HEADS, D_FF, dropout=0.0, use_cross_attention=False)
    out = to_numpy(decoder(x, decoder_padding_mask=mask))
    changed = x.copy()
    changed[:, 2] = 100.0 * rng.normal(size=(2, D_MODEL))
    new_out = to_numpy(decoder(changed, decoder_padding_mask=mask))
    np.testing.assert_allclose(np.delete(new_out, 2, axis=1), np.delete(out, 2, axis=1), atol=1e-5)
    # Without the mask, the later positions read the changed key.
    assert np.abs(to_numpy(decoder(changed))[:, 3:] - to_numpy(decoder(x))[:, 3:]).max() > 1e-3


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_cached_steps_equal_the_full_pass(norm_first):
    """The public cache API: Decoder.empty_cache, then calls with self_attention_cache and cache_index.

    Steps of several tokens (the prompt in one pass) and of one token at a time.
    """
    model = gpt_model(norm_first=norm_first)
    embedding, decoder, projection = gpt_layers(model)
    ids = random_ids(np.random.default_rng(3), 3, 8)
    full = to_numpy(model(ids))
    cache = decoder.empty_cache(batch_size=3, cache_length=8)
    steps, start = [], 0
    for size in (3, 1, 1, 2, 1):
        x = embedding(ids[:, start : start + size], start_index=start)
        x, cache = decoder(x, self_attention_cache=cache, cache_index=start)
        steps.append(to_numpy(projection(x)))
        start += size
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Training: a model that learns to repeat a pattern (conftest's `trained_lm`)

def test_decoder_only_model_learns_the_next_token_under_fit(trained_lm):
    """Each row predicts its tokens 1..15 from the ones before. Token 1 (b) cannot be known:
    ln(11) nats. Every later token repeats the one two back, so the best loss is
    ln(11) / 15 = 0.16. A model that does not look back (the current token alone, or
    nothing) stays at about ln(11) = 2.40 everywhere: below 0.6 it reads the earlier
    positions through causal self-attention."""
    _, loss = trained_lm
    floor = math.log(PATTERN_VOCAB - 1) / (PATTERN_LENGTH - 1)
    assert floor < loss < 0.6
