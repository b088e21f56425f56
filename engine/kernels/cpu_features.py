"""What the CPU offers, read once from ``/proc/cpuinfo``, and the prefill compute format chosen from it.

``cpu_flags()`` is the one reader of the CPU's feature flags: the kernels' build (engine/kernels/build.py) keys its
library on them, and ``prefill_compute_dtype`` chooses prefill's products from them. Tests feed either a flag set.

**The prefill compute format** (``EngineConfig.prefill_compute_dtype``, every pod's ``--prefill-compute-dtype``):
``float32`` (the bit-exact reference), ``bfloat16`` (prefill's products in bf16 with float32 accumulation,
engine/model/bf16_prefill.py), or ``auto``, which picks bfloat16 where the CPU multiplies bf16 natively and float32
elsewhere. The rule comes from torch's oneDNN products of SmolLM2's prefill shapes (512 x 576 @ 576 x 1536, one
pinned thread, on an AMD EPYC with avx512_bf16, no AMX; oneDNN capped at each ISA with ``ONEDNN_MAX_CPU_ISA``,
docs/PERFORMANCE.md has the table):

| CPU features | float32 GFLOP/s | bfloat16 GFLOP/s | auto |
|---|---|---|---|
| AVX2 only | 94 | 26 (emulated) | float32 |
| AVX-512 without BF16 | 98 | 86 (converted to float32) | float32 |
| ``avx512_bf16`` (``vdpbf16ps``) | 107 | 494 | bfloat16 |
| ``amx_bf16`` (tiles) | 143 | 1,125 (issue 34's Sapphire Rapids figures) | bfloat16 |

**The bf16 products' ISA** (``bf16_isas``): bf16 prefill's products run on the kernels' own tiling
(engine/kernels/bf16_kernels.py) on the best ISA the CPU has: AMX tiles, else avx512_bf16's ``vdpbf16ps``, else its
arithmetic on AVX2 FMAs. On AMD Zen 4 (avx512_bf16, no AMX) the kernels' products run at or above oneDNN's
(docs/PERFORMANCE.md, "Prefill compute format"), so every CPU class takes them: one tiling everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

PREFILL_COMPUTE_DTYPES = ("auto", "float32", "bfloat16")

# The flags under which a bf16 product runs natively, and (measured above) beats float32 on prefill's shapes.
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as ``/proc/cpuinfo`` lists them (its first processor); empty where it cannot be read
    (not Linux, or no flags line)."""
    return parse_cpuinfo(_cpuinfo_lines())


def cpu_model() -> str:
    """This CPU's model name (``AMD EPYC``, ``Intel(R) Xeon(R) Platinum 8481C``), for the benchmarks' tables."""
    return next((line.split(":", 1)[1].strip() for line in _cpuinfo_lines() if line.startswith("model name")),
                "unknown")


def parse_cpuinfo(lines: Iterable[str]) -> frozenset[str]:
    """The flags of the first ``flags`` line of a ``/proc/cpuinfo`` text."""
    for line in lines:
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.readlines()
    except OSError:
        return []


def prefill_compute_dtype(setting: str, device: str = "cpu", flags: Iterable[str] | None = None) -> str:
    """The format prefill's products compute in, ``float32`` or ``bfloat16``, for ``setting`` (one of
    ``PREFILL_COMPUTE_DTYPES``) on ``device`` with the CPU ``flags`` (default: this CPU's). ``auto`` picks bfloat16
    on a CPU with ``NATIVE_BF16_FLAGS`` and float32 elsewhere, other devices included (their engines choose their
    own ``dtype``)."""
    if setting not in PREFILL_COMPUTE_DTYPES:
        raise ValueError(f"prefill_compute_dtype must be one of {', '.join(PREFILL_COMPUTE_DTYPES)}, got {setting!r}")
    if setting != "auto":
        return setting
    if device.split(":")[0] != "cpu":
        return "float32"
    found = cpu_flags() if flags is None else frozenset(flags)
    return "bfloat16" if found & set(NATIVE_BF16_FLAGS) else "float32"


# The bf16 products' ISAs, best first, each with the flags it needs (BF16_ISAS in engine/kernels/bf16_kernels.py).
BF16_ISA_FLAGS = (("amx", ("amx_tile", "amx_bf16")), ("avx512_bf16", ("avx512_bf16", "avx512bw")),
                  ("fma", ("avx2", "fma")))


def bf16_isas(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """The ISAs bf16 products can run on with the CPU ``flags`` (default: this CPU's), best first: the engine takes
    the first the kernels' library confirms (the operating system may refuse AMX tiles)."""
    found = cpu_flags() if flags is None else frozenset(flags)
    return tuple(isa for isa, needs in BF16_ISA_FLAGS if set(needs) <= found)


# The flags that decide compute formats, in the order pods report them.
MATRIX_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def matrix_flags(flags: Iterable[str] | None = None) -> tuple[str, ...]:
    """Which of ``MATRIX_FLAGS`` the CPU has (default: this CPU): what pods report beside the resolved format, as a
    list in ``PodLoad.cpu_features`` and the handshake's ``KVLayout.cpu_features``."""
    found = cpu_flags() if flags is None else frozenset(flags)
    return tuple(f for f in MATRIX_FLAGS if f in found)


def matrix_features(flags: Iterable[str] | None = None) -> str:
    """``matrix_flags`` comma-separated (``avx2,avx512f,avx512_bf16``), or ``none``: one label value
    (``splitserve_engine_info``'s ``cpu_features``, the logs, the benchmarks' tables)."""
    return ",".join(matrix_flags(flags)) or "none"
