"""x @ W^T on CPU with W in 16-column blocks: the native kernel (blocked_linear.cpp) and its
torch reference.

Layout: `block_weight(W)` turns W [N, K] (N a multiple of 16) into blocks of 16 output columns:
float32 W_blocked [N/16, K, 16] (block b holds columns 16b..16b+15 of W^T); bfloat16 in pairs
of k, [N/16, ceil(K/2), 16, 2], the layout AVX512-BF16's dot product reads (odd K padded). The
layout is the same at every level of kernels/native/isa.py: only the kernel's vector width changes.

`widen=True` (bf16 W): the kernel widens W's tiles to float32 once per call and runs its float32
tiles, for many rows of x where the level has no bf16 dot product (AVX2); the same float32 FMAs
in the same order as the default form, so the same results.

The kernel is the operator `hybrid_engine_cpu::linear_blocked` (kernels/native/ops.py: built on first use for
the process's level, its checks and output allocation in C++), eagerly and in compiled graphs
alike. Where it cannot be built or run (level `none`, no compiler) `native_available()` is False
and callers keep their unblocked weights.
"""

from __future__ import annotations

import torch

from ..native.ops import native_ops

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
        return _page_aligned_copy(w.reshape(n // BLOCK, BLOCK, -1, 2).permute(0, 2, 1, 3))
    return _page_aligned_copy(w.transpose(1, 2))


def _page_aligned_copy(w: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of w that starts on a 4 KiB boundary. Where the allocator happened to put
    each blocked weight decided how fast the kernel ran it: the same weights ran their products
    up to a third slower at AVX2 from some addresses, which page alignment removed (the cause is
    not pinned down; 4K aliasing between the weight stream and the output rows fits it;
    benchmarks/RESULTS.md, issue 38's A/B). It costs at most 4 KiB a weight."""
    nbytes = w.numel() * w.element_size()
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8, device=w.device)
    start = -raw.data_ptr() % 4096
    return raw[start:start + nbytes].view(w.dtype).view(w.shape).copy_(w)


def unblock_weight(w_blocked: torch.Tensor, k: int) -> torch.Tensor:
    """The plain [N, K] weight back from its blocks."""
    if w_blocked.dim() == 4:
        w = w_blocked.permute(0, 2, 1, 3).reshape(w_blocked.shape[0], BLOCK, -1)[..., :k]
    else:
        w = w_blocked.transpose(1, 2)
    return w.reshape(-1, k)


def can_block(weight: torch.Tensor, padded: bool = False) -> bool:
    """Whether the kernel can run `weight`; padded: once its rows are padded to a multiple of BLOCK."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and (padded or weight.shape[0] % BLOCK == 0) and native_available())


def native_available() -> bool:
    return native_ops() is not None


def blocked_rows_reference(w_blocked: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """W[ids] [n, k] from the blocks, in torch indexing."""
    picked = w_blocked[ids // BLOCK, :, ids % BLOCK]           # [n, K] or [n, ceil(K/2), 2] (bf16)
    return picked.reshape(ids.shape[0], -1)[:, :k]


def blocked_rows(w_blocked: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """W[ids] [n, k] for int64 ids [n] of a blocked W of k columns, with the native kernel (a
    tied embedding table read from the blocked lm_head)."""
    return torch.ops.hybrid_engine_cpu.blocked_rows.default(w_blocked, ids, k)


def blocked_linear(x: torch.Tensor, w_blocked: torch.Tensor, widen: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] with the native kernel (`native_available()` must hold);
    widen: bf16 only, W's tiles widened to float32 once per call (see the module docstring)."""
    return torch.ops.hybrid_engine_cpu.linear_blocked.default(x, w_blocked, widen)
