"""The SwiGLU activation silu(gate) * up with the native kernel silu_mul.cpp: one call instead of
the torch form's three ops (kernels/activation/reference.py `silu_mul_torch`, the reference and the form
taken wherever this one cannot run).

Eager calls only, as the norms of kernels/norm/cpu.py: a function torch.compile traces keeps the torch
form, which inductor fuses into its own kernel. The kernel is the torch op `silu_mul` of
kernels/native/ops.py (C++ in ops.cpp: checks, output allocation)."""

from __future__ import annotations

import functools

import torch

from ..native.ops import native_ops
from . import reference

DTYPES = (torch.float32, torch.bfloat16)


def can_run_native(x: torch.Tensor) -> bool:
    """Whether the kernel serves x [..., 2I]: an eager call (not traced, no autograd) on a CPU
    tensor of float32 or bf16 with its last dim contiguous and even."""
    return (x.is_cpu and x.dtype in DTYPES and x.dim() >= 1 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad)
            and native_available())


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    return native_ops() is not None


def silu_mul_native(x: torch.Tensor, level: str | None = None) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I] in x.dtype. level: the kernel built for
    that level of kernels/native/isa.py (None: this process's; tests run each level below it)."""
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"silu_mul_native: no kernel at level {level}")
    return ops.silu_mul.default(x)


def silu_mul(x):
    if can_run_native(x):
        return silu_mul_native(x)
    return reference.silu_mul_torch(x)
