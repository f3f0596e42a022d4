"""A decoder-only (GPT-style) model from the library's layers: no cross-attention, the cache, generation."""

import math
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from conftest import SUBPROCESS_ENV, VOCAB, random_ids

D_MODEL, HEADS, D_FF = 16, 2, 32


def _gpt(vocab=VOCAB, d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, num_layers=2, norm_first=False):
    """A user's functional language model: ids -> PositionalEmbedding -> Decoder without cross-attention -> Dense."""
    ids = keras.Input(shape=(None,), dtype="int32", name="ids")
    embedding = kt.PositionalEmbedding(vocab, d_model, name="embedding")
    decoder = kt.Decoder(num_layers, d_model, num_heads, d_ff, dropout=0.0, norm_first=norm_first,
                         use_cross_attention=False, name="decoder")
    projection = keras.layers.Dense(vocab, name="projection")
    return keras.Model(ids, projection(decoder(embedding(ids))))


def _layers(model):
    return model.get_layer("embedding"), model.get_layer("decoder"), model.get_layer("projection")


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
    model = _gpt()
    rng = np.random.default_rng(0)
    ids = random_ids(rng, 2, 8)
    logits = model(ids).numpy()
    for t in range(ids.shape[1] - 1):
        changed = ids.copy()
        changed[:, t + 1 :] = random_ids(rng, 2, ids.shape[1] - t - 1)
        assert (changed[:, t + 1 :] != ids[:, t + 1 :]).any()
        new_logits = model(changed).numpy()
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
        x = tf.identity(embedding(token_ids))  # a new tensor: no Keras mask to fall back on
        return decoder(x, decoder_padding_mask=kt.padding_mask(token_ids)).numpy()

    np.testing.assert_allclose(hidden(padded)[:, :6][real], hidden(ids)[real], atol=1e-5)

    # The functional model, where only the Keras mask PositionalEmbedding attaches carries the padding.
    model = _gpt()
    np.testing.assert_allclose(model(padded).numpy()[:, :6][real], model(ids).numpy()[real], atol=1e-5)


def test_a_key_the_padding_mask_marks_is_never_attended():
    """Right padding is invisible to a causal decoder anyway; a masked key before real ones shows the mask is used."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 6, D_MODEL)).astype("float32")
    mask = np.ones((2, 6), bool)
    mask[:, 2] = False
    decoder = kt.Decoder(2, D_MODEL, HEADS, D_FF, dropout=0.0, use_cross_attention=False)
    out = decoder(x, decoder_padding_mask=mask).numpy()
    changed = x.copy()
    changed[:, 2] = 100.0 * rng.normal(size=(2, D_MODEL))
    new_out = decoder(changed, decoder_padding_mask=mask).numpy()
    np.testing.assert_allclose(np.delete(new_out, 2, axis=1), np.delete(out, 2, axis=1), atol=1e-5)
    # Without the mask, the later positions read the changed key.
    assert np.abs(decoder(changed).numpy()[:, 3:] - decoder(x).numpy()[:, 3:]).max() > 1e-3


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_cached_steps_equal_the_full_pass(norm_first):
    """The public cache API: Decoder.empty_cache, then calls with self_attention_cache and cache_index.

    Steps of several tokens (the prompt in one pass) and of one token at a time.
    """
    model = _gpt(norm_first=norm_first)
    embedding, decoder, projection = _layers(model)
    ids = random_ids(np.random.default_rng(3), 3, 8)
    full = model(ids).numpy()
    cache = decoder.empty_cache(batch_size=3, max_length=8)
    steps, start = [], 0
    for size in (3, 1, 1, 2, 1):
        x = embedding(ids[:, start : start + size], start_index=start)
        x, cache = decoder(x, self_attention_cache=cache, cache_index=start)
        steps.append(projection(x).numpy())
        start += size
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Training, saving and generating: a model that learns to repeat a pattern

PATTERN_VOCAB, PERIOD, LENGTH = 12, 2, 16


def _repeated_patterns(rng, n):
    """Rows `a b a b ...` of LENGTH tokens, a and b drawn uniformly from ids 1..11 (0 is padding)."""
    pattern = rng.integers(1, PATTERN_VOCAB, size=(n, PERIOD))
    return np.tile(pattern, (1, LENGTH // PERIOD)).astype("int32")


@pytest.fixture(scope="module")
def trained():
    """A 2-layer d_model=32 decoder-only model fitted for 3 epochs (48 steps) on 512 rows: a few seconds."""
    keras.utils.set_random_seed(0)
    data = _repeated_patterns(np.random.default_rng(0), 512)
    model = _gpt(vocab=PATTERN_VOCAB, d_model=32, num_heads=4, d_ff=64)
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=kt.MaskedSparseCategoricalCrossentropy(0.0))
    history = model.fit(data[:, :-1], data[:, 1:], batch_size=32, epochs=3, verbose=0)
    return model, history.history["loss"][-1]


def test_decoder_only_model_learns_the_next_token_under_fit(trained):
    """Each row predicts its tokens 1..15 from the ones before. Token 1 (b) cannot be known:
    ln(11) nats. Every later token repeats the one two back, so the best loss is
    ln(11) / 15 = 0.16. A model that does not look back (the current token alone, or
    nothing) stays at about ln(11) = 2.40 everywhere: below 0.6 it reads the earlier
    positions through causal self-attention."""
    _, loss = trained
    floor = math.log(PATTERN_VOCAB - 1) / (LENGTH - 1)
    assert floor < loss < 0.6


def _reference_generation(model, prompt, max_new_tokens):
    """Greedy generation as defined: the whole prefix through the model at every step, never the pad id 0."""
    tokens = prompt
    for _ in range(max_new_tokens):
        logits = model(tokens).numpy()[:, -1]
        logits[:, kt.PAD_ID] = -np.inf
        tokens = np.concatenate([tokens, logits.argmax(-1)[:, None].astype("int32")], axis=1)
    return tokens[:, prompt.shape[1] :]


def test_greedy_generate_in_a_tf_function_equals_rerunning_the_prefix(trained):
    model, _ = trained
    generate = tf.function(
        lambda ids: kt.greedy_generate(*_layers(model), ids, max_new_tokens=10),
        input_signature=[tf.TensorSpec([None, None], tf.int32)],  # one graph for any batch and prompt length
    )
    for prompt in (_repeated_patterns(np.random.default_rng(4), 3)[:, :5], np.array([[7], [3]], "int32")):
        tokens, log_prob = generate(prompt)
        reference = _reference_generation(model, prompt, 10)
        np.testing.assert_array_equal(tokens.numpy(), reference)
        assert tokens.shape == (prompt.shape[0], 10) and log_prob.shape == (prompt.shape[0],)
    # The learned behaviour: a prompt a b a b a goes on b a b a ...
    prompt = _repeated_patterns(np.random.default_rng(5), 4)
    tokens, log_prob = generate(prompt[:, :5])
    np.testing.assert_array_equal(tokens.numpy(), prompt[:, 5:15])


def test_greedy_generate_stops_each_row_at_end_id(trained):
    model, _ = trained
    prompt = _repeated_patterns(np.random.default_rng(6), 3)[:, :3]
    tokens, _ = kt.greedy_generate(*_layers(model), prompt, max_new_tokens=6)
    tokens = tokens.numpy()
    end_id = int(tokens[0, 2])
    stopped, _ = kt.greedy_generate(*_layers(model), prompt, max_new_tokens=6, end_id=end_id)
    for row, stopped_row in zip(tokens, stopped.numpy()):
        ends = np.flatnonzero(row == end_id)
        cut = ends[0] + 1 if ends.size else len(row)
        np.testing.assert_array_equal(stopped_row[:cut], row[:cut])
        assert (stopped_row[cut:] == kt.PAD_ID).all()


LOAD_SCRIPT = r"""
import sys
import keras, numpy as np
import keras_transformer as kt

path, ids_file, out_file = sys.argv[1:]
model = keras.models.load_model(path)
ids = np.load(ids_file)
layers = [model.get_layer(name) for name in ("embedding", "decoder", "projection")]
tokens, _ = kt.greedy_generate(*layers, ids[:, :5], max_new_tokens=8)
np.savez(out_file, logits=model(ids).numpy(), tokens=tokens.numpy())
"""


def test_decoder_only_model_round_trips_through_a_keras_file_in_a_fresh_process(trained, tmp_path):
    model, _ = trained
    ids = _repeated_patterns(np.random.default_rng(7), 3)
    ids[2, 12:] = 0  # padding too
    model.save(tmp_path / "lm.keras")
    np.save(tmp_path / "ids.npy", ids)
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(tmp_path / "lm.keras"), str(tmp_path / "ids.npy"),
         str(tmp_path / "out.npz")],
        capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(loaded["logits"], model(ids).numpy())
    tokens, _ = kt.greedy_generate(*_layers(model), ids[:, :5], max_new_tokens=8)
    np.testing.assert_array_equal(loaded["tokens"], tokens.numpy())
