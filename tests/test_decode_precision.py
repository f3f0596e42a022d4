"""The exported decoder computes in the precision that is fast on the CPU, not in the training policy,
in as many loops as the exporting machine has CPUs, and under XLA on weights laid out as XLA reads them fastest;
the weights reach the serving engine through one mapping that fails loudly when a weight is left unmapped."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_transformer as kt
from export.engine_weights import assign_by_path, engine_model
from export.search import engine_beam_search, engine_greedy_decode
from export.translator import MAX_AUTO_LOOPS, XLA_DTYPE, decode_loops, decode_policy


def _numpy(weights):
    return [keras.ops.convert_to_numpy(w) for w in weights]


def test_auto_decodes_in_float32_on_every_cpu_and_bfloat16_only_when_asked():
    """bfloat16 is not batch-invariant where it is native (docs/design.md, "The engine decodes in float32 by
    default"), so the default never picks it."""
    assert decode_policy("auto", flags={"avx2", "fma"})[0] == "float32"
    assert decode_policy("auto", flags={"avx2", "avx512f"})[0] == "float32"
    policy, reason = decode_policy("auto", flags={"avx2", "avx512f", "avx512_bf16"})
    assert policy == "float32" and "avx512_bf16" in reason and "--precision bfloat16" in reason
    assert decode_policy("auto", flags={"amx_bf16"})[0] == "float32"
    assert decode_policy("float32", flags={"avx512_bf16"})[0] == "float32"
    assert decode_policy("bfloat16", flags=set())[0] == "bfloat16"
    assert decode_policy("model")[0] is None
    with pytest.raises(ValueError, match="precision must be one of auto, float32, bfloat16, model"):
        decode_policy("fp16")


def test_a_model_trained_in_mixed_bfloat16_decodes_in_the_chosen_policy_with_its_weights():
    model = kt.Transformer.from_preset("tiny", vocab_size=32, dtype="mixed_bfloat16")
    model.build()
    source = np.array([[5, 6, 7, 3, 0]], "int32")
    target = np.array([[2, 8, 9]], "int32")
    float32 = engine_model(model, "float32")
    assert float32 is not model and model.dtype_policy.name == "mixed_bfloat16"
    assert {w.dtype for w in float32.weights} == {"float32"}
    assert [w.path for w in float32.weights] == [w.path for w in model.weights]
    for ours, theirs in zip(_numpy(float32.weights), _numpy(model.weights)):
        np.testing.assert_array_equal(ours, theirs)
    bfloat16 = engine_model(model, "bfloat16")
    assert {w.dtype for w in bfloat16.weights} == {"bfloat16"}
    # bfloat16 weights are the mixed policy's per-use casts, stored once: the same logits up to rounding.
    mixed = keras.ops.convert_to_numpy(model((source, target)))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bfloat16((source, target))), mixed, atol=0.1)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(float32((source, target))), mixed, atol=0.1)
    # Nothing to change: the model itself.
    assert engine_model(model, None) is model and engine_model(model, "mixed_bfloat16") is model


@pytest.mark.parametrize("tied", [True, False])
def test_the_xla_copy_computes_the_models_logits_and_decodes_the_same(tied):
    """The XLA decoder's copy stores a tied output projection untied, `[d_model, vocab]`: the same
    logits (float32, the products summed in another order), the same greedy and beam output under XLA."""
    model = kt.Transformer.from_preset("tiny", vocab_size=32, tie_output_embedding=tied, dtype="mixed_bfloat16")
    model.build()
    copy = engine_model(model, XLA_DTYPE, untie_output_projection=True)
    assert copy.output_projection is not None and {w.dtype for w in copy.weights} == {"float32"}
    assert model.dtype_policy.name == "mixed_bfloat16" and model.tie_output_embedding == tied
    embeddings = keras.ops.convert_to_numpy(model.target_embedding.token_embedding.embeddings)
    if tied:  # the embedding transposed, and a bias of 0
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(copy.output_projection.kernel), embeddings.T)
        assert not keras.ops.convert_to_numpy(copy.output_projection.bias).any()
    source = np.array([[5, 6, 7, 8, 3, 0], [9, 10, 3, 0, 0, 0]], "int32")
    target = np.array([[2, 8, 9, 11], [2, 12, 13, 0]], "int32")
    reference = engine_model(model, "float32")
    assert (reference.output_projection is None) == tied
    np.testing.assert_allclose(keras.ops.convert_to_numpy(copy((source, target))),
                               keras.ops.convert_to_numpy(reference((source, target))), rtol=1e-5, atol=1e-5)
    for search in (lambda m, s: engine_greedy_decode(m, s, 2, 3, fixed_shapes=True),
                   lambda m, s: engine_beam_search(m, s, 2, 3, beam_size=3, fixed_shapes=True)):
        ours = tf.function(lambda s: search(copy, s), jit_compile=True)(source)
        theirs = tf.function(lambda s: search(reference, s), jit_compile=True)(source)
        np.testing.assert_array_equal(ours[0].numpy(), theirs[0].numpy())
        np.testing.assert_allclose(ours[1].numpy(), theirs[1].numpy(), rtol=1e-5)
    if not tied:  # an untied model's projection is copied; in float32 it needs no copy at all
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(copy.output_projection.kernel),
                                      keras.ops.convert_to_numpy(model.output_projection.kernel))
        assert engine_model(reference, XLA_DTYPE, untie_output_projection=True) is reference


def test_a_weight_the_mapping_leaves_out_is_named():
    """A weight of the model with no place in the copy (a layer the library added), or a weight of the copy
    given no value, stops the mapping with the weights' paths: no copy decodes with initial weights."""
    model = kt.Transformer.from_preset("tiny", vocab_size=32)
    model.decoder.add_weight(shape=(4,), name="new_gate")  # a weight the model's config does not rebuild
    model.build()
    with pytest.raises(ValueError, match=r"weights with no place in the copy: decoder/new_gate$"):
        engine_model(model, "bfloat16")

    model = kt.Transformer.from_preset("tiny", vocab_size=32)
    model.build()
    copy = kt.Transformer.from_preset("tiny", vocab_size=32, dtype="bfloat16")
    copy.build()
    values = {w.path.removeprefix(f"{model.name}/"): keras.ops.convert_to_numpy(w) for w in model.weights}
    del values["decoder/layer_1/feed_forward/outer/bias"]
    with pytest.raises(ValueError, match="weights of the copy given no value: decoder/layer_1/feed_forward/outer/bias"):
        assign_by_path(copy, values)


def test_auto_loops_follow_the_cpus_and_a_bad_count_is_named():
    assert decode_loops("auto", cpus=1)[0] == 1
    loops, reason = decode_loops("auto", cpus=2)
    assert loops == 2 and "2 CPUs" in reason
    assert decode_loops("auto", cpus=64)[0] == MAX_AUTO_LOOPS
    assert decode_loops("3", cpus=64)[0] == 3 and decode_loops(1)[0] == 1
    with pytest.raises(ValueError, match="parallel_loops must be >= 1 or 'auto', got 0"):
        decode_loops(0)
