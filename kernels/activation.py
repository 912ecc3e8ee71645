"""The SwiGLU MLP's activation: silu(gate) * up, of the merged gate_up projection's output.

Not a backend op (kernels/dispatch.py): the choice is by the tensor alone, the native kernel for
eager CPU calls and the torch ops everywhere else (inductor and a GPU fuse those themselves)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu.silu_mul import can_run_native, silu_mul_native


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I], gate then up -> silu(gate) * up: [..., I] in x.dtype.

    On CPU, where the native kernel runs (kernels/cpu/silu_mul.cpp, an eager call), the call is
    that kernel; the torch form below serves everywhere else and is its reference.
    """
    if can_run_native(x):
        return silu_mul_native(x)
    return silu_mul_torch(x)


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """silu_mul in torch ops (the same contract)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
