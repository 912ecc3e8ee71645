"""The GDN layer's conv update for decode and verify steps (B rows of T new tokens, the window
after each token written to its slot) with the native kernel causal_conv1d_update.cpp: one
call per layer instead of the torch form's ~12 ops (kernels/conv/reference.py
`causal_conv1d_update` is the reference, and the form taken wherever this one cannot run).

Under torch.compile and eagerly alike the call is the operator
`hybrid_engine_cpu::causal_conv1d_update` (kernels/native/ops.py, C++ from the checks to the kernel): one
extern call of a graph."""

from __future__ import annotations

import torch

from ..native.ops import native_ops
from ..slot_pool import DecodeRows
from . import reference

DTYPES = (torch.float32, torch.bfloat16)
KERNEL_SIZES = (2, 3, 4)


def can_run_native(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CPU tensors of float32 or bf16, the pool in x's
    dtype and contiguous, channels contiguous in x, a kernel size of 2 to 4."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype in DTYPES
            and window_pool.dtype == x.dtype and window_pool.is_contiguous() and x.stride(-1) == 1
            and weight.shape[1] in KERNEL_SIZES and native_available())


# (a constant to traced graphs: compiled_steps.py marks it so, where torch.compile is imported)
def native_available() -> bool:
    return native_ops() is not None


def conv_update_native(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                       read_slots: torch.Tensor, write_slots: torch.Tensor,
                       level: str | None = None) -> torch.Tensor:
    """The reference's contract (x [B, T, D]; weight [D, K]; window_pool [S, D, K-1] in x.dtype,
    modified in place; read_slots [B]; write_slots [B, T], < 0 skipped) -> y [B, T, D] in
    x.dtype. Any slots may alias: every window is read before any is written, and writes go
    in token order, rows in order within a token. level: the kernel built for that level of
    kernels/native/isa.py (None: this process's; tests run each level below it)."""
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"conv_update_native: no kernel at level {level}")
    return ops.causal_conv1d_update.default(x, weight, window_pool, read_slots, write_slots)


def conv_update_op(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                   read_slots: torch.Tensor, write_slots: torch.Tensor) -> torch.Tensor:
    """conv_update_native at this process's level, where `can_run_native` holds (the form
    callers and compiled graphs use: no lookup of the level's ops)."""
    return torch.ops.hybrid_engine_cpu.causal_conv1d_update.default(x, weight, window_pool, read_slots, write_slots)


def causal_conv1d_update(x, weight, window_pool, read_slots, write_slots, rows: DecodeRows | None = None):
    if can_run_native(x, weight, window_pool):    # any slots: the kernel reads all first too
        return conv_update_op(x, weight, window_pool, read_slots, write_slots)
    return reference.causal_conv1d_update_torch(x, weight, window_pool, read_slots, write_slots, rows)
