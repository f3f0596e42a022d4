"""The training precision: mixed precision only where the hardware computes it natively
(`keras_transformer.hardware` reads the CPU flags)."""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.hardware import native_bf16_flags


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    return [tuple(tf.config.experimental.get_device_details(gpu).get("compute_capability") or (0, 0))
            for gpu in tf.config.list_physical_devices("GPU")]


def choose_policy(setting, flags=None, gpu_capabilities=None) -> tuple[str, str]:
    """(Keras dtype policy, the reason in a few words) for `setting`: "auto", True or False.

    True forces mixed precision (mixed_float16 on a GPU, mixed_bfloat16 on a CPU), False forces
    float32. "auto": on GPUs, mixed_bfloat16 from compute capability 8.0 (Ampere), mixed_float16
    from 7.0 (tensor cores), else float32; on a CPU, mixed_bfloat16 only with native bfloat16
    (`keras_transformer.hardware.NATIVE_BF16_CPU_FLAGS`). `flags` and `gpu_capabilities` default to this machine's.
    """
    gpus = gpu_compute_capabilities() if gpu_capabilities is None else gpu_capabilities
    if setting is True:
        return ("mixed_float16" if gpus else "mixed_bfloat16"), "mixed precision was asked for"
    if setting is False:
        return "float32", "float32 was asked for"
    if setting != "auto":
        raise ValueError(f'mixed_precision must be "auto", true or false, got {setting!r}')
    if gpus:
        oldest = min(gpus)
        if oldest >= (8, 0):
            return "mixed_bfloat16", f"the GPUs compute bfloat16 natively (compute capability {oldest[0]}.{oldest[1]})"
        if oldest >= (7, 0):
            return "mixed_float16", f"the GPUs have float16 tensor cores (compute capability {oldest[0]}.{oldest[1]})"
        return "float32", f"the GPUs have no fast half precision (compute capability {oldest[0]}.{oldest[1]})"
    native = native_bf16_flags(flags)
    if native:
        return "mixed_bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", "the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16), where it is slower than float32"
