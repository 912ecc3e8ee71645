"""x @ W^T on CPU with W in 16-column blocks: the native kernel (blocked_linear.cpp) and its
torch reference.

Layout: `block_weight(W)` turns W [N, K] (N a multiple of 16) into W_blocked [N/16, K, 16],
block b holding columns 16b..16b+15 of W^T. Float32 and bfloat16.

The kernel is compiled on first use with the machine's C++ compiler (`CXX`, else c++ / g++)
and its native instruction set, into a cache directory (HYBRID_ENGINE_CACHE_DIR, else
~/.cache/hybrid-engine), and called through ctypes; it shares torch's OpenMP runtime (the
same libgomp.so.1 is already loaded) and its thread count. Where it cannot be built or run
(no compiler, no AVX-512F, not x86-64 Linux) `native_available()` is False and callers keep
their unblocked weights. Under torch.compile the call is the custom op
`hybrid_engine_cpu::blocked_linear`, so inductor leaves it as one extern call.
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

import torch

SOURCE = Path(__file__).with_name("blocked_linear.cpp")
BLOCK = 16
DTYPES = (torch.float32, torch.bfloat16)


def blocked_linear_reference(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T from W_blocked [N/16, K, 16] -> [M, N] (float32 accumulation)."""
    y = torch.matmul(x.float(), w_blocked.float())           # [N/16, M, 16]
    return y.transpose(0, 1).reshape(x.shape[0], w_blocked.shape[0] * BLOCK).to(x.dtype)


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if n % BLOCK:
        raise ValueError(f"block_weight: {n} output rows is not a multiple of {BLOCK}")
    return weight.detach().reshape(n // BLOCK, BLOCK, k).transpose(1, 2).contiguous()


def can_block(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.shape[0] % BLOCK == 0 and native_available())


def native_available() -> bool:
    return _library() is not None


def blocked_linear(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] with the native kernel (`native_available()` must hold)."""
    if torch.compiler.is_compiling():
        return torch.ops.hybrid_engine_cpu.blocked_linear(x, w_blocked)
    return _blocked_linear_native(x, w_blocked)


def _blocked_linear_native(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    nb, k, _ = w_blocked.shape
    if x.shape[-1] != k or x.dtype != w_blocked.dtype:
        raise ValueError(f"blocked_linear: x {tuple(x.shape)} {x.dtype} does not fit a blocked "
                         f"weight of K={k}, {w_blocked.dtype}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, nb * BLOCK, dtype=x.dtype)
    if m:
        fn = _library().blocked_linear_f32 if x.dtype == torch.float32 else _library().blocked_linear_bf16
        fn(x2.data_ptr(), w_blocked.data_ptr(), y.data_ptr(), m, nb * BLOCK, k, torch.get_num_threads())
    return y.reshape(*lead, nb * BLOCK)


@torch.library.custom_op("hybrid_engine_cpu::blocked_linear", mutates_args=())
def _blocked_linear_op(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    return _blocked_linear_native(x, w_blocked)


@_blocked_linear_op.register_fake
def _(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w_blocked.shape[0] * BLOCK)


# ---- building and loading the kernel ---------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("HYBRID_ENGINE_NATIVE_KERNELS", "1") == "0":
        return None
    if platform.system() != "Linux" or platform.machine() != "x86_64" or not _cpu_has("avx512f"):
        return None
    try:
        path = _build()
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as e:
        warnings.warn(f"hybrid-engine: the native CPU linear kernel could not be built ({e}); "
                      "using torch's matmuls", stacklevel=2)
        return None
    args = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    for fn in (lib.blocked_linear_f32, lib.blocked_linear_bf16):
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _cpu_has(flag: str) -> bool:
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


def _build() -> Path:
    """Compiles the kernel once per source, compiler and machine; later calls find the file."""
    cxx = _compiler()
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "")
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join([cxx, *flags, cpu]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("HYBRID_ENGINE_CACHE_DIR", Path.home() / ".cache" / "hybrid-engine"))
    target = cache / f"blocked_linear-{key}.so"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:       # build aside, then rename: atomic
        out = Path(tmp) / target.name
        subprocess.run([cxx, *flags, str(SOURCE), "-o", str(out)], check=True, capture_output=True,
                       timeout=300)
        os.replace(out, target)
    return target
