"""What the CPU computes natively: the precision that is fastest on it.

bfloat16 on a CPU without native support is emulated and slower than float32,
and faster than float32 with AVX512_BF16 or AMX (docs/design.md, "Training
precision and oneDNN, from the CPU"), so training (`kt-train`'s
`"mixed_precision": "auto"`) reads the CPU flags, and `kt-export` names them
when it could decode in bfloat16.
"""

from __future__ import annotations

from pathlib import Path

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


def native_bf16_flags(flags=None) -> list[str]:
    """The flags of `NATIVE_BF16_CPU_FLAGS` the CPU has (`flags`: this machine's by default)."""
    flags = cpu_flags() if flags is None else set(flags)
    return sorted(flag for flag in NATIVE_BF16_CPU_FLAGS if flag in flags)
