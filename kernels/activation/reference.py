"""The SwiGLU MLP's activation: silu(gate) * up, of the merged gate_up projection's output, in
torch ops (the reference; the cpu backend's native form is kernels/activation/cpu.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2I], gate then up -> silu(gate) * up: [..., I] in x.dtype."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
