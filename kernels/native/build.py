"""Builds the native kernels and their torch operators (ops.cpp) into one shared library per
instruction-set level on first use, and loads it (torch.ops.load_library).

Compiled with the machine's C++ compiler (`CXX`, else c++ / g++ / clang++). Each kernel source is
compiled for one level of kernels/native/isa.py (the process's own by default), never blindly for
the build machine (-march=native would let the compiler use instructions the chosen level
excludes). ops.cpp, which holds no SIMD code, is compiled once for every level and namespace,
with torch's headers and no level flags (parsing those headers takes 10-20 s: a good part of
the build); ops_namespace.cpp names the library's op namespace (build.namespace). The objects
are compiled at once, then linked against torch. Objects and
libraries go to a cache directory (HYBRID_ENGINE_CACHE_DIR, else ~/.cache/hybrid-engine), keyed by
their sources and headers, the compiler, the flags (so the level), the torch version and the CPU
model, so later processes only load the library. The kernels use OpenMP and run on torch's
runtime (the libgomp.so.1 torch already loaded) with torch's thread count.

`load_ops` returns None where the kernels cannot run: HYBRID_ENGINE_NATIVE_KERNELS=0, level
`none`, or no working compiler (with a warning); callers then keep their torch paths.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from .isa import LEVELS, cpu_level

HERE = Path(__file__).parent
KERNELS = HERE.parent          # the op folders; sources include headers by their path from here
SOURCES = tuple(KERNELS / name for name in ("linear/blocked_linear.cpp", "linear/quant_linear.cpp", "linear/quantize_int4.cpp",
                                            "linear/quant_rows.cpp", "gdn/gdn_recurrent.cpp",
                                            "attention/paged_attention.cpp", "conv/causal_conv1d_update.cpp",
                                            "norm/rms_norm.cpp", "gdn/gdn_decode.cpp", "activation/silu_mul.cpp",
                                            "sampling/token_bitmask.cpp"))
OPS_SOURCE = HERE / "ops.cpp"
NAMESPACE_SOURCE = HERE / "ops_namespace.cpp"
HEADERS = (HERE / "simd.h", HERE / "kernels.h", HERE / "stealing_ranges.h", KERNELS / "linear" / "blocked_tiles.h", KERNELS / "linear" / "quant_layout.h",
           KERNELS / "gdn" / "delta_rule.h", KERNELS / "activation" / "silu_mul.h")
NAMESPACE = "hybrid_engine_cpu"

KERNEL_FLAGS = ["-O3", "-fopenmp", "-fPIC", "-std=c++17"]
# What each level lets the compiler emit; the sources pick their vector width from the macros
# these define (simd.h). -mtune only schedules for this CPU, it adds no instruction.
LEVEL_FLAGS = {
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-mtune=native"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mtune=native"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mavx512vnni", "-mtune=native"],
}
# The wrappers only check, allocate and call: -O1 optimises them as well as -O3 and compiles
# faster. C++20 and the ABI flag as torch's own extensions build.
OPS_FLAGS = ["-O1", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
TORCH_DIR = Path(torch.__file__).parent


def namespace(level: str) -> str:
    """The op namespace of `level`'s library: the process's own level defines `hybrid_engine_cpu`
    (the ops every caller and compiled graph uses), a lower one `hybrid_engine_cpu_<level>`."""
    return NAMESPACE if level == cpu_level() else f"{NAMESPACE}_{level}"


def load_ops(level: str | None = None) -> torch._ops._OpNamespace | None:
    """The ops built for `level` (None: this process's level), or None where they cannot run.
    A level above the process's is refused (ValueError): its code could fault here."""
    level = cpu_level() if level is None else level
    if level not in LEVELS or LEVELS.index(level) > LEVELS.index(cpu_level()):
        raise ValueError(f"load_ops: level {level!r} is not one this process may run "
                         f"(its level is {cpu_level()})")
    return _load(level)


def library_name(level: str | None = None) -> str | None:
    """The file name of the library `load_ops(level)` loaded (it carries the key of its sources,
    headers, compiler, flags and torch version), or None where no library is loaded."""
    level = cpu_level() if level is None else level
    return _build(level).name if load_ops(level) is not None else None


@functools.lru_cache(maxsize=None)
def _load(level: str) -> torch._ops._OpNamespace | None:
    if os.environ.get("HYBRID_ENGINE_NATIVE_KERNELS", "1") == "0" or level == "none":
        return None
    try:
        torch.ops.load_library(str(_build(level)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or b"").decode(errors="replace").strip()[-500:]
        warnings.warn(f"hybrid-engine: the native kernels could not be built for {level} "
                      f"({e}{': ' + detail if detail else ''}); using the torch paths", stacklevel=3)
        return None
    return getattr(torch.ops, namespace(level))


def _compiler() -> str:
    for candidate in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise OSError("no C++ compiler found (set CXX)")


def _key(*parts: bytes | str) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else part.encode())
        digest.update(b"\0")
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)       # _load and library_name ask for it: keys computed once
def _build(level: str) -> Path:
    """The library for `level`: its objects compiled (in parallel) where the cache lacks them,
    then linked against torch."""
    cxx = _compiler()
    cache = Path(os.environ.get("HYBRID_ENGINE_CACHE_DIR", Path.home() / ".cache" / "hybrid-engine"))
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    headers = b"".join(h.read_bytes() for h in HEADERS)
    jobs = {}                                                    # object path -> compile command
    kernel_flags = [*KERNEL_FLAGS, *LEVEL_FLAGS[level], f"-I{KERNELS}"]
    for source in SOURCES:
        key = _key(source.read_bytes(), headers, cxx, *kernel_flags, cpu)
        jobs[cache / f"{source.stem}-{level}-{key}.o"] = [cxx, *kernel_flags, "-c", str(source)]
    ops_flags = [*OPS_FLAGS, f"-I{HERE}", f"-isystem{TORCH_DIR / 'include'}"]
    key = _key(OPS_SOURCE.read_bytes(), headers, cxx, *ops_flags, torch.__version__)
    jobs[cache / f"ops-{key}.o"] = [cxx, *ops_flags, "-c", str(OPS_SOURCE)]
    name_flags = ["-fPIC", f"-DHYBRID_ENGINE_OPS={namespace(level)}"]
    key = _key(NAMESPACE_SOURCE.read_bytes(), cxx, *name_flags)
    jobs[cache / f"ops_namespace-{namespace(level)}-{key}.o"] = [cxx, *name_flags, "-c", str(NAMESPACE_SOURCE)]
    library = cache / f"{NAMESPACE}-{level}-{_key(*(p.name for p in jobs))}.so"
    if library.exists():
        return library
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
        missing = {target: Path(tmp) / target.name for target in jobs if not target.exists()}
        _run_all([[*jobs[target], "-o", str(out)] for target, out in missing.items()])
        for target, out in missing.items():
            os.replace(out, target)
        out = Path(tmp) / library.name
        _run_all([[cxx, "-shared", "-fopenmp", *map(str, jobs), f"-L{TORCH_DIR / 'lib'}", "-lc10", "-ltorch_cpu",
                   f"-Wl,-rpath,{TORCH_DIR / 'lib'}", "-o", str(out)]])
        os.replace(out, library)
    return library


def _run_all(commands: list[list[str]]) -> None:
    """Runs the commands at once; raises CalledProcessError (with stderr) for the first that fails."""
    running = [(c, subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE)) for c in commands]
    failed = None
    for command, process in running:
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        if process.returncode and failed is None:
            failed = subprocess.CalledProcessError(process.returncode, command, stdout, stderr)
    if failed is not None:
        raise failed
