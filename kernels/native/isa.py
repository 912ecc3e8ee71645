"""The one CPU capability probe: which instruction-set level the native kernels and oneDNN's
packed bf16/fp16 weights may use in this process.

Levels, lowest first:
- `none`: torch's own paths only (no native kernel, no oneDNN-packed weights);
- `avx2`: AVX2 + FMA + F16C, the native kernels on 8-float vectors (bf16 widened to float32
  in registers: AVX2 has no bf16 dot product);
- `avx512`: AVX-512 F/BW/VL/DQ on top of that, 16-float vectors; oneDNN's bf16 packing;
- `avx512_bf16`: AVX512-BF16 (and AVX512-VNNI, which every such CPU has) as well: the native
  bf16 products use its dot product, the quantized ones VNNI's integer one.

The level is read once per process from the CPU's flags (/proc/cpuinfo), capped by what torch
itself found (`torch.backends.cpu.get_cpu_capability()`, which also honours
ATEN_CPU_CAPABILITY), and may be lowered with HYBRID_ENGINE_CPU_ISA=avx512_bf16|avx512|avx2|none
so one machine can run and test every level below its own. An override above what the CPU has
is an error, never a claim: no code path may call an instruction the CPU lacks.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import torch

LEVELS = ("none", "avx2", "avx512", "avx512_bf16")
ENV = "HYBRID_ENGINE_CPU_ISA"

# The /proc/cpuinfo flags each level needs on top of the one below it. avx512 asks for BW/VL/DQ
# as well as F because torch's AVX512 kernels and oneDNN's bf16 check (mkldnn_bf16_device_check)
# both do, and the kernels' masked 16-bit stores are AVX512-BW/VL instructions.
_NEEDS = {
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx512_bf16", "avx512_vnni"),   # every CPU with the first has the second
}
# torch.backends.cpu.get_cpu_capability() -> the highest level torch's dispatch allows.
_TORCH_CAPABILITY = {"DEFAULT": "none", "AVX2": "avx2", "AVX512": "avx512_bf16"}


def level_from_flags(flags: set[str] | frozenset[str]) -> str:
    """The highest level whose flags (and every lower level's) are all in `flags`."""
    level = "none"
    for candidate in LEVELS[1:]:
        if not all(f in flags for f in _NEEDS[candidate]):
            break
        level = candidate
    return level


def missing_flags(level: str, flags: set[str] | frozenset[str]) -> list[str]:
    """The CPU flags `level` needs that `flags` lacks (empty where it may run)."""
    needed = [f for name in LEVELS[1:LEVELS.index(level) + 1] for f in _NEEDS[name]]
    return [f for f in needed if f not in flags]


def choose_level(detected: str, override: str | None) -> str:
    """The level to run at: `detected`, or `override` (HYBRID_ENGINE_CPU_ISA) when set; an
    unknown override, or one above `detected`, raises ValueError."""
    if override is None or override == "":
        return detected
    value = override.strip().lower()
    if value not in LEVELS:
        raise ValueError(f"{ENV}={override!r} is not a CPU level; choose one of {', '.join(LEVELS)}")
    if LEVELS.index(value) > LEVELS.index(detected):
        raise ValueError(f"{ENV}={value} asks for more than this CPU offers (its level is {detected}); "
                         "the override can only lower the level")
    return value


def at_least(level: str) -> bool:
    """Whether this process runs at `level` or above."""
    return LEVELS.index(cpu_level()) >= LEVELS.index(level)


@functools.lru_cache(maxsize=None)
def cpu_level() -> str:
    """This process's level: the detected one, lowered by HYBRID_ENGINE_CPU_ISA (read once)."""
    return choose_level(detected_level(), os.environ.get(ENV))


@functools.lru_cache(maxsize=None)
def detected_level() -> str:
    """What the CPU and torch together allow, before any override."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return "none"       # the kernels are x86-64 code; /proc/cpuinfo is Linux's
    flags = cpu_flags()
    from_torch = _TORCH_CAPABILITY.get(torch.backends.cpu.get_cpu_capability(), "none")
    return min(level_from_flags(flags), from_torch, key=LEVELS.index)


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    return flags_from_cpuinfo(_cpuinfo())


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _first_field(text: str, name: str) -> str | None:
    """The first processor's `name` field of /proc/cpuinfo text (every core lists the same)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value
    return None


def flags_from_cpuinfo(text: str) -> frozenset[str]:
    """The first processor's `flags` line of /proc/cpuinfo text."""
    return frozenset((_first_field(text, "flags") or "").split())


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` may be reordered into oneDNN's packed layout
    (`torch.ops.mkldnn._reorder_linear_weight`): only where torch's own check passes (bf16:
    AVX512 BW/VL/DQ or AVX-NE-CONVERT; fp16: AVX512-FP16, AVX-NE-CONVERT or AMX-FP16, else the
    reorder raises) and the level is avx512 or above (so the override can turn it off)."""
    if not (torch.backends.mkldnn.is_available() and at_least("avx512")):
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if dtype == torch.float16:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False
