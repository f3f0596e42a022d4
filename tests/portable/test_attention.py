"""Our MultiHeadAttention computes what keras.layers.MultiHeadAttention computes, from the same weights.

Ours projects with 2-D matmuls and 4-D batched matmuls (faster to train); Keras'
layer is the reference implementation of paper equation 1 and the MultiHead
formula, so outputs, attention weights and gradients must agree.
"""

import keras
import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from portable.conftest import gradients, to_numpy


def _twins(num_heads=4, key_dim=8, dtype=None, **kwargs):
    ours = kt.MultiHeadAttention(num_heads, key_dim, dtype=dtype, **kwargs)
    reference = keras.layers.MultiHeadAttention(num_heads, key_dim, dtype=dtype, **kwargs)
    return ours, reference


def _same_weights(ours, reference, query, value, **kwargs):
    ours(query, value, **kwargs)
    reference(query, value, **kwargs)
    rng = np.random.default_rng(0)
    # Random biases too, so that a bias added in the wrong place shows.
    weights = [rng.normal(size=w.shape).astype("float32") * 0.3 for w in ours.get_weights()]
    ours.set_weights(weights)
    reference.set_weights(weights)


@pytest.fixture
def inputs():
    rng = np.random.default_rng(1)
    query = ops.convert_to_tensor(rng.normal(size=(3, 5, 16)).astype("float32"))
    memory = ops.convert_to_tensor(rng.normal(size=(3, 7, 16)).astype("float32"))
    memory_mask = ops.convert_to_tensor(np.arange(7)[None, :] < np.array([[7], [4], [2]]))
    return query, memory, memory_mask


@pytest.mark.parametrize(
    "case", ["self", "self_causal", "cross_masked", "cross_separate_key", "keras_masks"]
)
def test_outputs_and_weights_equal_keras(inputs, case):
    query, memory, memory_mask = inputs
    ours, reference = _twins()
    value = query if case.startswith("self") else memory
    _same_weights(ours, reference, query, value)
    kwargs = {"return_attention_scores": True}
    if case == "self_causal":
        kwargs["use_causal_mask"] = True
    if case == "cross_masked":
        kwargs["attention_mask"] = memory_mask[:, None, :]
    if case == "cross_separate_key":
        kwargs["key"] = ops.flip(memory, axis=-1)
    if case == "keras_masks":  # as an Embedding(mask_zero=True) attaches them
        embed = keras.layers.Embedding(10, 16, mask_zero=True)
        query = embed(ops.convert_to_tensor([[1, 2, 3, 4, 5], [1, 2, 3, 0, 0], [5, 4, 3, 2, 1]]))
        value = embed(ops.where(memory_mask, 7, 0))
    out, scores = ours(query, value, **kwargs)
    ref_out, ref_scores = reference(query, value, **kwargs)
    np.testing.assert_allclose(to_numpy(out), to_numpy(ref_out), atol=1e-5)
    np.testing.assert_allclose(to_numpy(scores), to_numpy(ref_scores), atol=1e-6)


@pytest.mark.parametrize("case", ["self_causal", "cross_masked"])
def test_a_key_size_apart_from_the_value_size_equals_keras(inputs, case):
    """d_k = 3 for queries and keys, d_v = 8 for values (Keras' `key_dim` and `value_dim`; the paper's table 3,
    rows B): the full pass and the cached one, fixed buffer and cross-attention cache, compute Keras' layer."""
    query, memory, memory_mask = inputs
    ours, reference = _twins(key_dim=3, value_dim=8)
    value = query if case == "self_causal" else memory
    # Keras' layer returning its scores: its own product. Without them it calls `ops.dot_product_attention`,
    # which on JAX (jax.nn.dot_product_attention) takes values only as wide as the keys.
    _same_weights(ours, reference, query, value, return_attention_scores=True)
    w = ours.projections
    assert (w.query.kernel.shape, w.key.kernel.shape, w.value.kernel.shape, w.output.kernel.shape) == (
        (16, 4, 3), (16, 4, 3), (16, 4, 8), (4, 8, 16))
    kwargs = {"use_causal_mask": True} if case == "self_causal" else {"attention_mask": memory_mask[:, None, :]}
    expected, expected_scores = (to_numpy(t) for t in reference(query, value, return_attention_scores=True, **kwargs))
    out, scores = ours(query, value, return_attention_scores=True, **kwargs)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(scores), expected_scores, atol=1e-6)
    np.testing.assert_allclose(to_numpy(ours(query, value, **kwargs)), expected, atol=1e-5)
    if case == "self_causal":
        cache = ours.empty_cache(3, 5)
        assert [tuple(t.shape) for t in cache] == [(3, 4, 5, 3), (3, 4, 5, 8)]
        steps = []
        for t in range(5):
            y, cache = ours(query[:, t:t + 1], query[:, t:t + 1], cache=cache, cache_index=t)
            steps.append(to_numpy(y))
        cached = np.concatenate(steps, axis=1)
    else:
        cache = ours.compute_cache(memory)
        assert [tuple(t.shape) for t in cache] == [(3, 4, 7, 3), (3, 4, 7, 8)]
        cached = to_numpy(ours(query, memory, cache=cache, attention_mask=memory_mask[:, None, :])[0])
    np.testing.assert_allclose(cached, expected, atol=1e-5)


def test_gradients_equal_keras(inputs):
    query, memory, memory_mask = inputs
    ours, reference = _twins()
    _same_weights(ours, reference, query, memory)

    def layer_gradients(layer):
        def loss(query, memory):
            out = layer(query, memory, attention_mask=memory_mask[:, None, :])
            return ops.sum(out * ops.sin(out))

        return gradients(loss, [query, memory], layer.trainable_variables)[1]

    for ours_grad, ref_grad in zip(layer_gradients(ours), layer_gradients(reference), strict=True):
        np.testing.assert_allclose(ours_grad, ref_grad, atol=1e-4)


def test_mixed_bfloat16_computes_in_bfloat16_like_keras(inputs):
    query, memory, _ = inputs
    ours, reference = _twins(dtype="mixed_bfloat16")
    _same_weights(ours, reference, query, memory)
    out, ref_out = ours(query, memory), reference(query, memory)
    assert keras.backend.standardize_dtype(out.dtype) == keras.backend.standardize_dtype(ref_out.dtype) == "bfloat16"
    assert all(w.dtype == "float32" for w in ours.weights)
    np.testing.assert_allclose(
        to_numpy(ops.cast(out, "float32")), to_numpy(ops.cast(ref_out, "float32")), atol=0.1, rtol=0.05
    )


def test_attention_dropout_is_applied_in_training_only(inputs):
    query, _, _ = inputs
    layer = kt.MultiHeadAttention(4, 8, dropout=0.5, seed=0)
    inference = layer(query, query, training=False)
    np.testing.assert_allclose(to_numpy(layer(query, query, training=False)), to_numpy(inference))
    assert not np.allclose(to_numpy(layer(query, query, training=True)), to_numpy(inference))


def test_options_beyond_the_paper_run_keras_code_and_refuse_the_cache(inputs):
    query, _, _ = inputs
    ours, reference = _twins(use_gate=True)
    _same_weights(ours, reference, query, query)
    np.testing.assert_allclose(to_numpy(ours(query, query)), to_numpy(reference(query, query)), atol=1e-5)
    with pytest.raises(ValueError, match="cache supports plain multi-head attention only"):
        ours(query[:, :1], query[:, :1], cache=ours.empty_cache(3, 5), cache_index=0)


def test_explicit_query_mask_gives_masked_queries_no_attention(inputs):
    query, memory, memory_mask = inputs
    query_mask = ops.convert_to_tensor([[True] * 5, [True] * 3 + [False] * 2, [False] + [True] * 4])
    _, scores = kt.MultiHeadAttention(4, 8)(
        query, memory, query_mask=query_mask, value_mask=memory_mask, return_attention_scores=True
    )
    weight_per_query = to_numpy(ops.sum(scores, axis=-1))  # [batch, heads, query_len]
    expected = np.broadcast_to(to_numpy(query_mask)[:, None, :], weight_per_query.shape).astype("float32")
    np.testing.assert_allclose(weight_per_query, expected, atol=1e-6)


def test_attention_over_one_key_weighs_it_1_without_a_warning(inputs, recwarn):
    # The first step of a cached decode attends to one key: Keras' softmax warned at each such call.
    query, memory, memory_mask = inputs
    layer = kt.MultiHeadAttention(4, 8)
    one_key_mask = ops.convert_to_tensor(np.array([[True], [False], [True]]))
    out, scores = layer(query, memory[:, :1], value_mask=one_key_mask, return_attention_scores=True)
    assert not [w for w in recwarn if "softmax" in str(w.message)], [str(w.message) for w in recwarn]
    expected = np.broadcast_to(to_numpy(one_key_mask)[:, None, None, :], scores.shape).astype("float32")
    np.testing.assert_array_equal(to_numpy(scores), expected)
    # A key of weight 1 contributes its whole value: the output is the projected value, at every query.
    np.testing.assert_allclose(to_numpy(out)[0], np.broadcast_to(to_numpy(out)[0, :1], out.shape[1:]), atol=1e-6)
