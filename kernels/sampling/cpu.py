"""The token mask of structured outputs with the native kernel token_bitmask.cpp, in place: a
word of 32 allowed tokens costs one compare, the rest masked stores (the torch form,
kernels/sampling/reference.py, unpacks every bit; xgrammar's own CPU kernel visits every token).
The kernel is the torch op `apply_token_bitmask` of kernels/native/ops.py."""

from __future__ import annotations

import functools

import torch

from ..native.ops import native_ops
from . import reference


def can_run_native(logits: torch.Tensor, bitmask: torch.Tensor) -> bool:
    """Whether the kernel serves logits [N, V] float32 (vocab contiguous) with bitmask [N, W]
    int32 (W >= ceil(V/32), words contiguous), both on the CPU, in an eager call."""
    return (logits.is_cpu and bitmask.is_cpu and logits.dtype == torch.float32 and bitmask.dtype == torch.int32
            and logits.dim() == 2 and bitmask.dim() == 2 and logits.shape[0] == bitmask.shape[0]
            and bitmask.shape[1] * 32 >= logits.shape[1] and logits.stride(-1) == 1 and bitmask.stride(-1) == 1
            and not torch.compiler.is_compiling() and native_available())


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    return native_ops() is not None


def apply_token_bitmask_native(logits: torch.Tensor, bitmask: torch.Tensor, level: str | None = None) -> None:
    """In place. level: the kernel built for that level of kernels/native/isa.py (None: this
    process's; tests run each level below it)."""
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"apply_token_bitmask_native: no kernel at level {level}")
    ops.apply_token_bitmask.default(logits, bitmask)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    if can_run_native(logits, bitmask):
        apply_token_bitmask_native(logits, bitmask)
    else:
        reference.apply_token_bitmask_torch(logits, bitmask)
