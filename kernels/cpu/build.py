"""Builds a kernel's C++ source into a shared library on first use and loads it (ctypes).

Compiled with the machine's C++ compiler (`CXX`, else c++ / g++ / clang++) for an instruction-set
level of kernels/cpu/isa.py (the process's own by default), never blindly for the build machine
(-march=native would let the compiler use instructions the chosen level excludes). Built into a
cache directory (HYBRID_ENGINE_CACHE_DIR, else ~/.cache/hybrid-engine), keyed by the source, the
shared SIMD header, the compiler, the flags (so the level) and the CPU model, so later processes
only load it. The libraries use OpenMP and run on torch's runtime (the libgomp.so.1 torch
already loaded) with torch's thread count, passed per call. Returns None where a kernel cannot
run: HYBRID_ENGINE_NATIVE_KERNELS=0, level `none`, or no working compiler (with a warning);
callers then keep their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from .isa import LEVELS, cpu_level

FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# What each level lets the compiler emit; the sources pick their vector width from the macros
# these define (simd.h). -mtune only schedules for this CPU, it adds no instruction.
LEVEL_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mtune=native"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mtune=native"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mtune=native"],
}
SIMD_HEADER = Path(__file__).with_name("simd.h")


@functools.lru_cache(maxsize=None)
def load_library(source: Path, level: str | None = None) -> ctypes.CDLL | None:
    """The kernel built for `level` (None: this process's level), or None where it cannot run.
    A level above the process's is refused (ValueError): its code could fault here."""
    level = cpu_level() if level is None else level
    if level not in LEVELS or LEVELS.index(level) > LEVELS.index(cpu_level()):
        raise ValueError(f"load_library: level {level!r} is not one this process may run "
                         f"(its level is {cpu_level()})")
    if os.environ.get("HYBRID_ENGINE_NATIVE_KERNELS", "1") == "0" or level == "none":
        return None
    try:
        return ctypes.CDLL(str(_build(source, level)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-500:]
        warnings.warn(f"hybrid-engine: the native kernel {source.name} could not be built for {level} "
                      f"({e}{': ' + detail if detail else ''}); using the torch path", stacklevel=2)
        return None


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise OSError("no C++ compiler found (set CXX)")


def _build(source: Path, level: str) -> Path:
    cxx = _compiler()
    flags = [*FLAGS, *LEVEL_FLAGS[level]]
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    key = hashlib.sha256(source.read_bytes() + SIMD_HEADER.read_bytes()
                         + " ".join([cxx, *flags, cpu]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HYBRID_ENGINE_CACHE_DIR", Path.home() / ".cache" / "hybrid-engine"))
    target = cache / f"{source.stem}-{level}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
        out = Path(tmp) / target.name
        subprocess.run([cxx, *flags, f"-I{SIMD_HEADER.parent}", str(source), "-o", str(out)], check=True,
                       capture_output=True, timeout=300)
        os.replace(out, target)
    return target
