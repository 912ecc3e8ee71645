"""x @ W^T on CPU with W in 16-column blocks: the native kernel (blocked_linear.cpp) and its
torch reference.

Layout: `block_weight(W)` turns W [N, K] (N a multiple of 16) into blocks of 16 output columns:
float32 W_blocked [N/16, K, 16] (block b holds columns 16b..16b+15 of W^T); bfloat16 in pairs
of k, [N/16, ceil(K/2), 16, 2], the layout AVX512-BF16's dot product reads (odd K padded). The
layout is the same at every level of kernels/cpu/isa.py: only the kernel's vector width changes.

`widen=True` (bf16 W): the kernel widens W's tiles to float32 once per call and runs its float32
tiles, for many rows of x where the level has no bf16 dot product (AVX2); the same float32 FMAs
in the same order as the default form, so the same results.

The kernel is built on first use for the process's level (kernels/cpu/build.py) and called
through ctypes. Where it cannot be built or run (level `none`, no compiler) `native_available()`
is False and callers keep their unblocked weights.
Under torch.compile the call is the graph op `hybrid_engine_cpu::linear_blocked` (graph_op.py),
so inductor leaves it as one extern call.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library
from .graph_op import define_graph_op

SOURCE = Path(__file__).with_name("blocked_linear.cpp")
BLOCK = 16
DTYPES = (torch.float32, torch.bfloat16)


def blocked_linear_reference(x: torch.Tensor, w_blocked: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T from a blocked W -> [M, N] (float32 accumulation)."""
    return (x.float() @ unblock_weight(w_blocked, x.shape[-1]).float().t()).to(x.dtype)


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    n, k = weight.shape
    if n % BLOCK:
        raise ValueError(f"block_weight: {n} output rows is not a multiple of {BLOCK}")
    w = weight.detach().reshape(n // BLOCK, BLOCK, k)
    if weight.dtype == torch.bfloat16:
        w = torch.nn.functional.pad(w, (0, k % 2))
        return w.reshape(n // BLOCK, BLOCK, -1, 2).permute(0, 2, 1, 3).contiguous()
    return w.transpose(1, 2).contiguous()


def unblock_weight(w_blocked: torch.Tensor, k: int) -> torch.Tensor:
    """The plain [N, K] weight back from its blocks."""
    if w_blocked.dim() == 4:
        w = w_blocked.permute(0, 2, 1, 3).reshape(w_blocked.shape[0], BLOCK, -1)[..., :k]
    else:
        w = w_blocked.transpose(1, 2)
    return w.reshape(-1, k)


def can_block(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.shape[0] % BLOCK == 0 and native_available())


def native_available() -> bool:
    return _library() is not None


def blocked_linear(x: torch.Tensor, w_blocked: torch.Tensor, widen: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] with the native kernel (`native_available()` must hold);
    widen: bf16 only, W's tiles widened to float32 once per call (see the module docstring)."""
    if torch.compiler.is_compiling():
        return _blocked_linear_op(x, w_blocked, widen)
    return _blocked_linear_native(x, w_blocked, widen)


def _blocked_linear_native(x: torch.Tensor, w_blocked: torch.Tensor, widen: bool = False) -> torch.Tensor:
    nb, steps = w_blocked.shape[:2]
    k = x.shape[-1]
    pairs = w_blocked.dim() == 4
    if x.dtype != w_blocked.dtype or steps != ((k + 1) // 2 if pairs else k):
        raise ValueError(f"blocked_linear: x {tuple(x.shape)} {x.dtype} does not fit a blocked "
                         f"weight {tuple(w_blocked.shape)} {w_blocked.dtype}")
    if widen and not pairs:
        raise ValueError("blocked_linear: widen=True is for bfloat16 weights")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, nb * BLOCK, dtype=x.dtype)
    if m:
        lib = _library()
        fn = (lib.blocked_linear_f32 if not pairs else
              lib.blocked_linear_bf16_widened if widen else lib.blocked_linear_bf16)
        fn(x2.data_ptr(), w_blocked.data_ptr(), y.data_ptr(), m, nb * BLOCK, k, torch.get_num_threads())
    return y.reshape(*lead, nb * BLOCK)


# `widen` has no default in the schema: inductor's C++ wrapper leaves out arguments equal to
# their default and hands the dispatcher a shorter stack (torch 2.13), so the op read `widen`
# from past it: garbage, True at times (an MTP pass's lm_head failed with "widen=True is for
# bfloat16 weights"). Without a default it is always passed. The op is named anew with that
# schema: inductor's on-disk cache keys graphs by their code, not by the schemas of the ops
# they call, and would serve graphs compiled for the old one (calls without `widen`).
_blocked_linear_op = define_graph_op(
    "linear_blocked(Tensor x, Tensor w_blocked, bool widen) -> Tensor", _blocked_linear_native,
    lambda x, w_blocked, widen=False: x.new_empty(*x.shape[:-1], w_blocked.shape[0] * BLOCK))


# ---- loading the kernel ------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        args = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
        for fn in (lib.blocked_linear_f32, lib.blocked_linear_bf16, lib.blocked_linear_bf16_widened):
            fn.argtypes, fn.restype = args, ctypes.c_int
    return lib
