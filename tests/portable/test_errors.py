"""Mistakes a user can make get a message that names what was wrong."""

import re

import numpy as np
import pytest

import keras_transformer as kt
from portable.conftest import jit, to_numpy


def test_d_model_not_divisible_by_heads():
    with pytest.raises(ValueError, match="d_model=30 and num_heads=4"):
        kt.Transformer(vocab_size=10, d_model=30, num_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        kt.EncoderLayer(d_model=10, num_heads=3, d_ff=8)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown preset 'huge'.*tiny, small, base, big"):
        kt.Transformer.from_preset("huge", vocab_size=10)


def test_vocabulary_must_be_given_once():
    with pytest.raises(ValueError, match="vocab_size"):
        kt.Transformer.from_preset("tiny")
    with pytest.raises(ValueError, match="vocab_size"):
        kt.Transformer.from_preset("tiny", vocab_size=10, source_vocab_size=10, target_vocab_size=10)


def test_wrong_input_rank(tiny_model):
    with pytest.raises(ValueError, match=r"source_ids of shape \[batch, length\] \(rank 2\), got shape \(5,\)"):
        tiny_model((np.ones(5, "int32"), np.ones((1, 5), "int32")))
    with pytest.raises(ValueError, match="target_ids of shape"):
        tiny_model((np.ones((1, 5), "int32"), np.ones((1, 5, 1), "int32")))


def test_float_ids_are_cast_like_keras_embedding_does(tiny_model):
    ids = np.array([[5, 6, 7, 3, 0]])
    as_int = tiny_model((ids.astype("int32"), ids.astype("int32")))
    as_float = tiny_model((ids.astype("float32"), ids.astype("float32")))
    np.testing.assert_array_equal(to_numpy(as_float), to_numpy(as_int))


def test_learned_positions_need_max_positions():
    with pytest.raises(ValueError, match="needs max_positions"):
        kt.PositionalEmbedding(10, 8, learned_positions=True)


def test_positions_past_a_learned_table_name_max_positions():
    """Past the table a gather fails obscurely on CPU (and returns zeros on GPU); the error names max_positions."""
    model = kt.Transformer.from_preset("tiny", vocab_size=10, learned_positions=True, max_positions=8)
    message = r"max_positions=8\).*needs max_positions >= start_index \+ length =\D*9"
    with pytest.raises(ValueError, match=message):
        model.encode(np.ones((2, 9), "int32"))
    with pytest.raises(ValueError, match=message):
        jit(model.encode)(np.ones((2, 9), "int32"))
    assert model.encode(np.ones((2, 8), "int32")).shape == (2, 8, 32)
    # One decoding step past the table too.
    with pytest.raises(ValueError, match=message):
        model.target_embedding(np.ones((2, 1), "int32"), start_index=8)


@pytest.mark.parametrize("key_dim", [0, -4, 2.5, True, "16"])
def test_a_key_size_must_be_a_positive_int(key_dim):
    with pytest.raises(ValueError, match=r"key_dim must be a positive int .* got " + re.escape(repr(key_dim))):
        kt.Transformer.from_preset("tiny", vocab_size=20, key_dim=key_dim)
