"""The exported decoder computes in the precision that is fast on the CPU, not in the training policy,
and in as many loops as the exporting machine has CPUs."""

import keras
import numpy as np
import pytest

import keras_transformer as kt
from export.translator import MAX_AUTO_LOOPS, decode_loops, decode_policy, with_dtype_policy


def test_auto_decodes_in_bfloat16_only_where_the_cpu_computes_it_natively():
    assert decode_policy("auto", flags={"avx2", "fma"})[0] == "float32"
    assert decode_policy("auto", flags={"avx2", "avx512f"})[0] == "float32"
    policy, reason = decode_policy("auto", flags={"avx2", "avx512f", "avx512_bf16"})
    assert policy == "bfloat16" and "avx512_bf16" in reason
    assert decode_policy("auto", flags={"amx_bf16"})[0] == "bfloat16"
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
    float32 = with_dtype_policy(model, "float32")
    assert float32 is not model and model.dtype_policy.name == "mixed_bfloat16"
    assert {w.dtype for w in float32.weights} == {"float32"}
    for ours, theirs in zip(float32.weights, model.weights):
        np.testing.assert_array_equal(keras.ops.convert_to_numpy(ours), keras.ops.convert_to_numpy(theirs))
    bfloat16 = with_dtype_policy(model, "bfloat16")
    assert {w.dtype for w in bfloat16.weights} == {"bfloat16"}
    # bfloat16 weights are the mixed policy's per-use casts, stored once: the same logits up to rounding.
    mixed = keras.ops.convert_to_numpy(model((source, target)))
    np.testing.assert_allclose(keras.ops.convert_to_numpy(bfloat16((source, target))), mixed, atol=0.1)
    np.testing.assert_allclose(keras.ops.convert_to_numpy(float32((source, target))), mixed, atol=0.1)
    assert with_dtype_policy(model, None) is model and with_dtype_policy(model, "mixed_bfloat16") is model


def test_auto_loops_follow_the_cpus_and_a_bad_count_is_named():
    assert decode_loops("auto", cpus=1)[0] == 1
    loops, reason = decode_loops("auto", cpus=2)
    assert loops == 2 and "2 CPUs" in reason
    assert decode_loops("auto", cpus=64)[0] == MAX_AUTO_LOOPS
    assert decode_loops("3", cpus=64)[0] == 3 and decode_loops(1)[0] == 1
    with pytest.raises(ValueError, match="parallel_loops must be >= 1 or 'auto', got 0"):
        decode_loops(0)
