"""Builds a kernel's C++ source into a shared library on first use and loads it (ctypes).

Compiled with the machine's C++ compiler (`CXX`, else c++ / g++ / clang++) for its native
instruction set, into a cache directory (HYBRID_ENGINE_CACHE_DIR, else ~/.cache/hybrid-engine),
keyed by the source, the compiler, the flags and the CPU model, so later processes only load
it. The libraries use OpenMP and run on torch's runtime (the libgomp.so.1 torch already
loaded) with torch's thread count, passed per call. Returns None where a kernel cannot run:
HYBRID_ENGINE_NATIVE_KERNELS=0, not x86-64 Linux, no AVX-512F, or no working compiler (with a
warning); callers then keep their torch paths.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


@functools.lru_cache(maxsize=None)
def load_library(source: Path) -> ctypes.CDLL | None:
    if os.environ.get("HYBRID_ENGINE_NATIVE_KERNELS", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not cpu_has("avx512f"):
        return None
    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"hybrid-engine: the native kernel {source.name} could not be built ({e}); "
                      "using the torch path", stacklevel=2)
        return None


def cpu_has(flag: str) -> bool:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return flag in line.split()
    except OSError:
        pass
    return False


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise OSError("no C++ compiler found (set CXX)")


def _build(source: Path) -> Path:
    cxx = _compiler()
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    key = hashlib.sha256(source.read_bytes() + " ".join([cxx, *FLAGS, cpu]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HYBRID_ENGINE_CACHE_DIR", Path.home() / ".cache" / "hybrid-engine"))
    target = cache / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
        out = Path(tmp) / target.name
        subprocess.run([cxx, *FLAGS, str(source), "-o", str(out)], check=True, capture_output=True,
                       timeout=300)
        os.replace(out, target)
    return target
