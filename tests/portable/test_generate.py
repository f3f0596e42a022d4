"""greedy_generate on a decoder-only (GPT-style) model from the library's layers, on every backend (the model
itself: test_decoder_only.py)."""

import subprocess
import sys

import numpy as np
import pytest

import keras_transformer as kt
from conftest import SUBPROCESS_ENV, gpt_layers, gpt_model, repeated_patterns
from portable.conftest import jit, to_numpy


def _reference_generation(model, prompt, max_new_tokens):
    """Greedy generation as defined: the whole prefix through the model at every step, never the pad id 0.

    Each pass reads one buffer `[batch, prompt_len + max_new_tokens]`, padded after the tokens so far (future
    positions, which the causal mask hides), so every pass has one shape and JAX's eager ops compile once."""
    n = prompt.shape[1]
    tokens = np.zeros((prompt.shape[0], n + max_new_tokens), "int32")
    tokens[:, :n] = prompt
    for t in range(n, n + max_new_tokens):
        logits = to_numpy(model(tokens))[:, t - 1]
        logits[:, kt.PAD_ID] = -np.inf
        tokens[:, t] = logits.argmax(-1)
    return tokens[:, n:]


def test_compiled_greedy_generate_equals_rerunning_the_prefix(trained_lm):
    model, _ = trained_lm
    generate = jit(lambda ids: kt.greedy_generate(*gpt_layers(model), ids, max_new_tokens=10))
    for prompt in (repeated_patterns(np.random.default_rng(4), 3)[:, :5], np.array([[7], [3]], "int32")):
        tokens, log_prob = generate(prompt)
        reference = _reference_generation(model, prompt, 10)
        np.testing.assert_array_equal(to_numpy(tokens), reference)
        assert tuple(tokens.shape) == (prompt.shape[0], 10) and tuple(log_prob.shape) == (prompt.shape[0],)
    # The learned behaviour: a prompt a b a b a goes on b a b a ...
    prompt = repeated_patterns(np.random.default_rng(5), 4)
    tokens, log_prob = generate(prompt[:, :5])
    np.testing.assert_array_equal(to_numpy(tokens), prompt[:, 5:15])


def test_greedy_generate_log_prob_is_the_sum_of_the_tokens_log_probabilities(trained_lm):
    model, _ = trained_lm
    prompt = repeated_patterns(np.random.default_rng(8), 2)[:, :3]
    tokens, log_prob = kt.greedy_generate(*gpt_layers(model), prompt, max_new_tokens=4)
    sequence = np.concatenate([prompt, to_numpy(tokens)], axis=1)
    logits = to_numpy(model(sequence[:, :-1])).astype("float64")[:, 2:]
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = np.take_along_axis(log_probs, sequence[:, 3:, None], axis=-1)[..., 0].sum(-1)
    np.testing.assert_allclose(to_numpy(log_prob), expected, rtol=1e-4)


def test_greedy_generate_names_a_bad_length():
    layers = gpt_layers(gpt_model())
    with pytest.raises(ValueError, match="max_new_tokens, a Python int >= 1, got 0"):
        kt.greedy_generate(*layers, np.ones((1, 2), "int32"), max_new_tokens=0)


def test_greedy_generate_stops_each_row_at_end_id(trained_lm):
    model, _ = trained_lm
    prompt = repeated_patterns(np.random.default_rng(6), 3)[:, :3]
    tokens, _ = kt.greedy_generate(*gpt_layers(model), prompt, max_new_tokens=6)
    tokens = to_numpy(tokens)
    end_id = int(tokens[0, 2])
    stopped, _ = kt.greedy_generate(*gpt_layers(model), prompt, max_new_tokens=6, end_id=end_id)
    for row, stopped_row in zip(tokens, to_numpy(stopped)):
        ends = np.flatnonzero(row == end_id)
        cut = ends[0] + 1 if ends.size else len(row)
        np.testing.assert_array_equal(stopped_row[:cut], row[:cut])
        assert (stopped_row[cut:] == kt.PAD_ID).all()


LOAD_SCRIPT = r"""
import sys
import keras, numpy as np
import keras_transformer as kt
from keras.ops import convert_to_numpy as to_numpy

path, ids_file, out_file = sys.argv[1:]
model = keras.models.load_model(path)
ids = np.load(ids_file)
layers = [model.get_layer(name) for name in ("embedding", "decoder", "projection")]
tokens, _ = kt.greedy_generate(*layers, ids[:, :5], max_new_tokens=8)
np.savez(out_file, logits=to_numpy(model(ids)), tokens=to_numpy(tokens))
"""


def test_decoder_only_model_round_trips_through_a_keras_file_in_a_fresh_process(trained_lm, tmp_path):
    model, _ = trained_lm
    ids = repeated_patterns(np.random.default_rng(7), 3)
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
    np.testing.assert_array_equal(loaded["logits"], to_numpy(model(ids)))
    tokens, _ = kt.greedy_generate(*gpt_layers(model), ids[:, :5], max_new_tokens=8)
    np.testing.assert_array_equal(loaded["tokens"], to_numpy(tokens))
