"""Incremental decoding with the key/value cache equals the full forward pass."""

import numpy as np
import tensorflow as tf

import keras_transformer as kt
from conftest import random_ids


def test_attention_cache_equals_full_causal_pass():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 16)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = mha(x, x, use_causal_mask=True).numpy()
    cache = mha.empty_cache(batch_size=2, max_length=6)
    for t in range(6):
        step, cache = mha(x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_index=t)
        np.testing.assert_allclose(step.numpy()[:, 0], full[:, t], atol=1e-5)


def test_cross_attention_cache_equals_full_pass():
    rng = np.random.default_rng(1)
    query = rng.normal(size=(2, 3, 16)).astype("float32")
    memory = rng.normal(size=(2, 5, 16)).astype("float32")
    memory_mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mha = kt.MultiHeadAttention(num_heads=2, key_dim=8)
    full = mha(query, memory, attention_mask=memory_mask[:, None, :]).numpy()
    cache = mha.compute_cache(memory)
    cached, _ = mha(query, memory, attention_mask=memory_mask[:, None, :], cache=cache)
    np.testing.assert_allclose(cached.numpy(), full, atol=1e-5)


def _step_by_step_logits(model, source, target):
    encoder_output = model.encode(source)
    mask = kt.padding_mask(source)
    cache = model.init_decoding_cache(encoder_output, max_length=target.shape[1])
    steps = []
    for t in range(target.shape[1]):
        logits, cache = model.decode_step(tf.constant(target[:, t]), t, encoder_output, mask, cache)
        steps.append(logits.numpy())
    return np.stack(steps, axis=1)


def test_model_incremental_decoding_equals_full_pass(tiny_model):
    rng = np.random.default_rng(2)
    source = random_ids(rng, 3, 7)
    source[2, 5:] = 0
    target = random_ids(rng, 3, 6)
    full = tiny_model((source, target)).numpy()
    np.testing.assert_allclose(_step_by_step_logits(tiny_model, source, target), full, atol=1e-5)


def test_incremental_decoding_equals_full_pass_pre_norm_separate_vocab():
    rng = np.random.default_rng(3)
    model = kt.Transformer.from_preset(
        "tiny", source_vocab_size=30, target_vocab_size=50, norm_first=True, tie_output_embedding=False
    )
    source = random_ids(rng, 2, 5, high=30)
    target = random_ids(rng, 2, 4, high=50)
    full = model((source, target)).numpy()
    assert full.shape == (2, 4, 50)
    np.testing.assert_allclose(_step_by_step_logits(model, source, target), full, atol=1e-5)


def test_decoding_works_on_a_model_never_called():
    model = kt.Transformer.from_preset("tiny", vocab_size=20)
    tokens, scores = kt.greedy_decode(model, np.array([[5, 6, 3]], "int32"), start_id=2, end_id=3, max_length=4)
    assert tokens.shape[0] == 1 and scores.shape == (1,)
