"""Incremental decoding with the key/value cache equals the full forward pass (the cache's three modes)."""

import keras
import numpy as np

import keras_transformer as kt
from conftest import random_ids
from keras_transformer.attention import AttentionOps
from portable.conftest import jit, to_numpy


def test_attention_cache_equals_full_causal_pass():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 16)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = to_numpy(mha(x, x, use_causal_mask=True))
    cache = mha.empty_cache(batch_size=2, cache_length=6)
    for t in range(6):
        step, cache = mha(x[:, t : t + 1], x[:, t : t + 1], cache=cache, cache_index=t)
        np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, t], atol=1e-5)


def test_cross_attention_cache_equals_full_pass():
    rng = np.random.default_rng(1)
    query = rng.normal(size=(2, 3, 16)).astype("float32")
    memory = rng.normal(size=(2, 5, 16)).astype("float32")
    memory_mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    mha = kt.MultiHeadAttention(num_heads=2, key_dim=8)
    full = to_numpy(mha(query, memory, attention_mask=memory_mask[:, None, :]))
    cache = mha.compute_cache(memory)
    cached, _ = mha(query, memory, attention_mask=memory_mask[:, None, :], cache=cache)
    np.testing.assert_allclose(to_numpy(cached), full, atol=1e-5)
    for t in range(3):  # one position at a time, as a decoding step reads it
        step, _ = mha(query[:, t : t + 1], memory, attention_mask=memory_mask[:, None, :], cache=cache)
        np.testing.assert_allclose(to_numpy(step)[:, 0], full[:, t], atol=1e-5)


def test_a_growing_cache_equals_the_full_causal_pass():
    """`AttentionOps(growing_cache=True)`: the cache starts empty and grows by each call's positions (one, then
    two at once, then the rest), with no buffer to size and no slot left unwritten."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 6, 16)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = to_numpy(mha(x, x, use_causal_mask=True))
    cache, growing = mha.empty_cache(batch_size=2, cache_length=0), AttentionOps(growing_cache=True)
    for start, stop in [(0, 1), (1, 3), (3, 4), (4, 6)]:
        part = x[:, start:stop]
        out, cache = mha(part, part, cache=cache, cache_index=start, attention_ops=growing)
        assert tuple(cache[0].shape) == (2, 4, stop, 4)
        np.testing.assert_allclose(to_numpy(out), full[:, start:stop], atol=1e-5)


def test_a_cached_self_attention_call_projects_through_its_attention_ops():
    """`AttentionOps.project` is how a cached self-attention call gets Q, K and V: a runtime's own projection
    (here one matmul per kernel, as the serving engine's) is called, and the call still equals the full pass."""
    from keras_transformer.linear import project_heads

    class OneMatmulEach(AttentionOps):
        calls = 0

        def project(self, x, denses):
            OneMatmulEach.calls += 1
            return [project_heads(x, [dense])[0] for dense in denses]

    rng = np.random.default_rng(9)
    x = rng.normal(size=(2, 4, 16)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = to_numpy(mha(x, x, use_causal_mask=True))
    cache, ops = mha.empty_cache(batch_size=2, cache_length=0), OneMatmulEach(growing_cache=True)
    for t in range(4):
        x_t = keras.ops.convert_to_tensor(x[:, t : t + 1])  # one tensor as query, key and value: self-attention
        out, cache = mha(x_t, x_t, cache=cache, cache_index=t, attention_ops=ops)
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], atol=1e-5)
    assert OneMatmulEach.calls == 4


def test_rows_read_their_group_entry_of_a_cross_attention_cache():
    """A cache of one entry per sentence, read by g consecutive rows each (beam search's hypotheses) = each row
    over its own copy of the sentence's keys, values and mask."""
    rng = np.random.default_rng(6)
    sentences, g = 2, 3
    query = rng.normal(size=(sentences * g, 2, 16)).astype("float32")
    memory = rng.normal(size=(sentences, 5, 16)).astype("float32")
    memory_mask = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]], bool)
    mha = kt.MultiHeadAttention(num_heads=2, key_dim=8)
    repeated_memory, repeated_mask = np.repeat(memory, g, axis=0), np.repeat(memory_mask, g, axis=0)
    full, full_scores = mha(query, repeated_memory, attention_mask=repeated_mask[:, None, :],
                            return_attention_scores=True)
    shared, shared_scores, _ = mha(query, None, cache=mha.compute_cache(memory),
                                   attention_mask=memory_mask[:, None, :], return_attention_scores=True)
    np.testing.assert_allclose(to_numpy(shared), to_numpy(full), atol=1e-5)
    np.testing.assert_allclose(to_numpy(shared_scores), to_numpy(full_scores), atol=1e-6)


def _step_by_step_logits(model, source, target, attention_ops=None):
    encoder_output = model.encode(source)
    mask = kt.padding_mask(source)
    cache_length = 0 if attention_ops and attention_ops.growing_cache else target.shape[1]
    cache = model.init_decoding_cache(encoder_output, cache_length=cache_length)
    steps = []
    for t in range(target.shape[1]):
        logits, cache = model.decode_step(target[:, t], t, encoder_output, mask, cache, attention_ops=attention_ops)
        steps.append(to_numpy(logits))
    return np.stack(steps, axis=1)


def test_model_incremental_decoding_equals_full_pass(tiny_model):
    rng = np.random.default_rng(2)
    source = random_ids(rng, 3, 7)
    source[2, 5:] = 0
    target = random_ids(rng, 3, 6)
    full = to_numpy(tiny_model((source, target)))
    np.testing.assert_allclose(_step_by_step_logits(tiny_model, source, target), full, atol=1e-5)
    growing = _step_by_step_logits(tiny_model, source, target, AttentionOps(growing_cache=True))
    np.testing.assert_allclose(growing, full, atol=1e-5)


def test_incremental_decoding_equals_full_pass_pre_norm_separate_vocab():
    rng = np.random.default_rng(3)
    model = kt.Transformer.from_preset(
        "tiny", source_vocab_size=30, target_vocab_size=50, norm_first=True, tie_output_embedding=False
    )
    source = random_ids(rng, 2, 5, high=30)
    target = random_ids(rng, 2, 4, high=50)
    full = to_numpy(model((source, target)))
    assert full.shape == (2, 4, 50)
    np.testing.assert_allclose(_step_by_step_logits(model, source, target), full, atol=1e-5)


def test_incremental_decoding_equals_full_pass_with_a_key_size_apart_from_the_value_size():
    """key_dim=3 (d_k) and d_v = d_model // num_heads = 8: caches of keys 3 wide and values 8 wide, fixed and
    growing, give the full pass's logits."""
    rng = np.random.default_rng(5)
    model = kt.Transformer.from_preset("tiny", vocab_size=30, key_dim=3)
    source, target = random_ids(rng, 2, 6, high=30), random_ids(rng, 2, 5, high=30)
    source[0, 4:] = 0
    full = to_numpy(model((source, target)))
    cache = model.init_decoding_cache(model.encode(source, training=False), 5)
    for name in ("self_attention", "cross_attention"):
        keys, values = cache[name][0]
        assert (keys.shape[1], keys.shape[3], values.shape[1], values.shape[3]) == (4, 3, 4, 8), name
    np.testing.assert_allclose(_step_by_step_logits(model, source, target), full, atol=1e-5)
    growing = _step_by_step_logits(model, source, target, AttentionOps(growing_cache=True))
    np.testing.assert_allclose(growing, full, atol=1e-5)


def test_decoding_works_on_a_model_never_called():
    model = kt.Transformer.from_preset("tiny", vocab_size=20)
    tokens, scores = kt.greedy_decode(model, np.array([[5, 6, 3]], "int32"), start_id=2, end_id=3, max_output_length=4)
    assert tokens.shape[0] == 1 and scores.shape == (1,)


def test_a_whole_prompt_then_steps_fill_the_buffer_like_the_full_pass():
    """Self-attention over a fixed buffer: several positions written at once (a prompt), then one at a
    time, compiled; every output equals the causal full pass, and the buffer's unwritten slots are never read."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 7, 16)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=4, key_dim=4)
    full = to_numpy(mha(x, x, use_causal_mask=True))
    step = jit(lambda q, cache, t: mha(q, q, cache=cache, cache_index=t))
    cache = mha.empty_cache(batch_size=2, cache_length=9)  # two slots more than written: never read
    prompt, cache = mha(x[:, :4], x[:, :4], cache=cache, cache_index=0)
    np.testing.assert_allclose(to_numpy(prompt), full[:, :4], atol=1e-5)
    for t in range(4, 7):
        out, cache = step(x[:, t : t + 1], cache, np.int32(t))
        np.testing.assert_allclose(to_numpy(out)[:, 0], full[:, t], atol=1e-5)
    assert to_numpy(cache[0]).shape == (2, 4, 9, 4)
    assert not to_numpy(cache[0])[:, :, 7:].any()


def test_the_cache_mode_is_the_arguments_not_a_shape():
    """With `cache_index` the cache is written (self-attention); without it, it is read as the projected
    memory (cross-attention), whatever its length."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(1, 1, 8)).astype("float32")
    memory = rng.normal(size=(1, 3, 8)).astype("float32")
    mha = kt.MultiHeadAttention(num_heads=2, key_dim=4)
    mha(x, x)
    cross, cross_cache = mha(x, memory, cache=mha.compute_cache(memory))
    np.testing.assert_allclose(to_numpy(cross), to_numpy(mha(x, memory)), atol=1e-5)
    assert to_numpy(cross_cache[0]).shape == (1, 2, 3, 4)  # returned unchanged
    self_out, self_cache = mha(x, x, cache=mha.empty_cache(1, 3), cache_index=0)
    np.testing.assert_allclose(to_numpy(self_out), to_numpy(mha(x, x)), atol=1e-5)
    assert to_numpy(self_cache[0])[:, :, 0].any() and not to_numpy(self_cache[0])[:, :, 1:].any()
