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
    for t in range(3):  # one position at a time, as a decoding step reads it
        step, _ = mha(query[:, t : t + 1], memory, attention_mask=memory_mask[:, None, :], cache=cache)
        np.testing.assert_allclose(step.numpy()[:, 0], full[:, t], atol=1e-5)


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


def test_a_cache_of_free_length_grows_in_a_while_loop():
    """Inside `tf.while_loop` with the cache length left free, each write appends (no mask needed)."""
    rng = np.random.default_rng(5)
    x = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = mha(x, x, use_causal_mask=True).numpy()

    @tf.function
    def step_by_step(x):
        def body(t, cache, outputs):
            y, cache = mha(x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_index=t)
            return t + 1, cache, outputs.write(t, y[:, 0])

        free = tf.TensorShape([2, 4, None, 4])
        _, cache, outputs = tf.while_loop(
            lambda t, *_: t < 6, body, (0, mha.empty_cache(2), tf.TensorArray(tf.float32, 6)),
            shape_invariants=(tf.TensorShape([]), (free, free), None),
        )
        return tf.transpose(outputs.stack(), [1, 0, 2]), cache

    stepped, cache = step_by_step(x)
    assert cache[0].shape == (2, 4, 6, 4)
    np.testing.assert_allclose(stepped.numpy(), full, atol=1e-5)


def test_a_bfloat16_decoding_step_hands_back_bfloat16_and_equals_the_full_pass():
    """A one-position step multiplies in float32 (Eigen's batched matmul, see `eigen_batch_matmul`) and
    rounds to the layer's dtype; self- and cross-attention, in a while loop as decoding runs it."""
    rng = np.random.default_rng(7)
    x = tf.constant(rng.normal(size=(2, 6, 16)).astype("float32"))
    memory = tf.constant(rng.normal(size=(2, 5, 16)).astype("float32"))
    memory_mask = tf.constant([[[True, True, True, False, False]], [[True] * 5]])
    self_mha = kt.MultiHeadAttention(num_heads=4, key_dim=4, dtype="mixed_bfloat16")
    cross_mha = kt.MultiHeadAttention(num_heads=4, key_dim=4, dtype="mixed_bfloat16")
    full = cross_mha(self_mha(x, x, use_causal_mask=True), memory, attention_mask=memory_mask)

    @tf.function
    def step_by_step(x):
        cross_cache = cross_mha.compute_cache(memory)

        def body(t, cache, outputs):
            y, cache = self_mha(x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_index=t)
            y, _ = cross_mha(y, memory, attention_mask=memory_mask, cache=cross_cache)
            return t + 1, cache, outputs.write(t, y[:, 0])

        free = tf.TensorShape([2, 4, None, 4])
        _, _, outputs = tf.while_loop(
            lambda t, *_: t < 6, body, (0, self_mha.empty_cache(2), tf.TensorArray(tf.bfloat16, 6)),
            shape_invariants=(tf.TensorShape([]), (free, free), None),
        )
        return tf.transpose(outputs.stack(), [1, 0, 2])

    stepped = step_by_step(x)
    assert stepped.dtype == full.dtype == tf.bfloat16
    # bfloat16 keeps 8 bits of mantissa: outputs of size ~1 agree to a few hundredths.
    np.testing.assert_allclose(tf.cast(stepped, tf.float32).numpy(), tf.cast(full, tf.float32).numpy(), atol=0.05)


def test_hypotheses_read_their_sentence_cross_attention_cache():
    """g rows per sentence over a cache of one entry per sentence (beam search) = each row over its own copy."""
    rng = np.random.default_rng(6)
    sentences, g = 2, 3
    query = rng.normal(size=(sentences * g, 1, 16)).astype("float32")
    memory = rng.normal(size=(sentences, 5, 16)).astype("float32")
    memory_mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    mha = kt.MultiHeadAttention(num_heads=2, key_dim=8)
    repeated_memory, repeated_mask = np.repeat(memory, g, axis=0), np.repeat(memory_mask, g, axis=0)
    full, full_scores = mha(query, repeated_memory, attention_mask=repeated_mask[:, None, :],
                            return_attention_scores=True)
    shared, scores, _ = mha(query, memory, attention_mask=memory_mask[:, None, :], cache=mha.compute_cache(memory),
                            return_attention_scores=True)
    np.testing.assert_allclose(shared.numpy(), full.numpy(), atol=1e-5)
    np.testing.assert_allclose(scores.numpy(), full_scores.numpy(), atol=1e-6)
