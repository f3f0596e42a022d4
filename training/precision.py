"""The training precision: mixed precision only where the hardware computes it natively.

bfloat16 on a CPU without native support is emulated and slower than float32
(measured 0.84x on an AVX2-only EPYC; about 2x faster with AVX512_BF16 or AMX),
so `"mixed_precision": "auto"` (the default) reads the CPU flags.
"""

from __future__ import annotations

from pathlib import Path

import tensorflow as tf

# CPU flags (as /proc/cpuinfo names them) of native bfloat16 matrix arithmetic.
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags(cpuinfo="/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none, e.g. not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    return [tuple(tf.config.experimental.get_device_details(gpu).get("compute_capability") or (0, 0))
            for gpu in tf.config.list_physical_devices("GPU")]


def choose_policy(setting, flags=None, gpu_capabilities=None) -> tuple[str, str]:
    """(Keras dtype policy, the reason in a few words) for `setting`: "auto", True or False.

    True forces mixed precision (mixed_float16 on a GPU, mixed_bfloat16 on a CPU), False forces
    float32. "auto": on GPUs, mixed_bfloat16 from compute capability 8.0 (Ampere), mixed_float16
    from 7.0 (tensor cores), else float32; on a CPU, mixed_bfloat16 only with native bfloat16
    (`NATIVE_BF16_CPU_FLAGS`). `flags` and `gpu_capabilities` default to this machine's.
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
    flags = cpu_flags() if flags is None else set(flags)
    native = sorted(flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags)
    if native:
        return "mixed_bfloat16", f"the CPU computes bfloat16 natively ({', '.join(native)})"
    return "float32", "the CPU has no native bfloat16 (no avx512_bf16 or amx_bf16), where it is slower than float32"
