"""x @ W^T on CPU with W in 16-column blocks: the native kernel (blocked_linear.cpp) and its
torch reference.

Layout: `block_weight(W)` turns W [N, K] (N a multiple of 16) into W_blocked [N/16, K, 16],
block b holding columns 16b..16b+15 of W^T. Float32 and bfloat16.

The kernel is built on first use (kernels/cpu/build.py) and called through ctypes. Where it
cannot be built or run `native_available()` is False and callers keep their unblocked weights.
Under torch.compile the call is the custom op `hybrid_engine_cpu::blocked_linear`, so inductor
leaves it as one extern call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library

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


# ---- loading the kernel ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        args = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        for fn in (lib.blocked_linear_f32, lib.blocked_linear_bf16):
            fn.argtypes, fn.restype = args, ctypes.c_int
    return lib
