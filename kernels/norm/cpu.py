"""Qwen3.5's RMSNorms with the native kernel rms_norm.cpp, one call each instead of the torch
forms' 8 to 25 ops: the zero-centred norm (reference.py `rms_norm_torch`), the same after the
residual add before it (`add_rms_norm_torch`), the GDN output's gated norm
(`gated_rms_norm_torch`) and the attention q/k norm with its partial RoPE
(`qk_norm_rope_torch`). Those are the references, and the forms the cpu backend's ops at the
end of this file take wherever these cannot run.

Eager calls only: a function torch.compile traces keeps the torch forms, which inductor fuses
into its own kernels. The kernels are the torch ops `rms_norm`, `add_rms_norm`, `gated_rms_norm`
and `qk_norm_rope` of kernels/native/ops.py (C++ in ops.cpp: checks, views, output allocation)."""

from __future__ import annotations

import functools

import torch

from ..native.ops import native_ops
from . import reference

DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 1024          # the kernel's q/k row buffer


def can_run_native(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel serves a norm of x over its last dim with `weight`: an eager call (not
    traced by torch.compile, no autograd) on CPU tensors of float32 or bf16, the last dim
    contiguous, one weight [D]."""
    return (x.is_cpu and x.dtype in DTYPES and weight.dtype in DTYPES
            and weight.dim() == 1 and weight.shape[0] == x.shape[-1] and x.stride(-1) == 1
            and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and native_available())


@functools.lru_cache(maxsize=None)
def native_available() -> bool:
    return native_ops() is not None


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, level: str | None = None) -> torch.Tensor:
    """x [..., D] (last dim contiguous) -> x * rsqrt(mean(x^2) + eps) * (1 + weight), x.dtype.
    level: the kernel built for that level of kernels/native/isa.py (None: this process's; tests
    run each level below it)."""
    return _ops(level).rms_norm.default(x, weight, eps)


def add_rms_norm_native(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                        level: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, h [..., D] of one dtype -> (x + h, its zero-centred norm), both x.dtype."""
    return _ops(level).add_rms_norm.default(x, h, weight, eps)


def gated_rms_norm_native(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          level: str | None = None) -> torch.Tensor:
    """x, z [..., D] of one dtype (z may be a strided slice) -> weight * rmsnorm(x) * silu(z)
    with a PLAIN weight, x.dtype (the reference's rounding points)."""
    return _ops(level).gated_rms_norm.default(x, z, weight, eps)


def can_run_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Whether qk_norm_rope_native serves these: q and k of one dtype with their last dims
    contiguous, both weights [hd] of one dtype, cos and sin in q's dtype, an even rotary width
    within the head."""
    hd, rot = q.shape[-1], cos.shape[-1]
    return (can_run_native(q, q_weight) and k.dtype == q.dtype and k.stride(-1) == 1 and k.shape[-1] == hd
            and k_weight.shape == q_weight.shape and k_weight.dtype == q_weight.dtype
            and cos.dtype == q.dtype and sin.dtype == q.dtype and hd <= MAX_HEAD_DIM and rot % 2 == 0
            and rot <= hd)


def qk_norm_rope_native(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                        eps: float, cos: torch.Tensor, sin: torch.Tensor, level: str | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, nh, hd], k [T, nkv, hd] (strided heads allowed); weights [hd]; cos, sin [T, rot] ->
    (q, k) normed and rotated, views of one [T, nh + nkv, hd] tensor as the reference returns."""
    nh = q.shape[1]
    out = _ops(level).qk_norm_rope.default(q, k, q_weight, k_weight, eps, cos, sin)
    return out[:, :nh], out[:, nh:]


@functools.lru_cache(maxsize=None)
def _ops(level: str | None):
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"rms_norm native: no kernels at level {level}")
    return ops


def rms_norm(x, weight, eps):
    if can_run_native(x, weight):
        return rms_norm_native(x, weight, eps)
    return reference.rms_norm_torch(x, weight, eps)


def add_rms_norm(x, h, weight, eps):
    if h.shape == x.shape and h.dtype == x.dtype and can_run_native(x, weight):
        return add_rms_norm_native(x, h, weight, eps)
    return reference.add_rms_norm_torch(x, h, weight, eps)


def gated_rms_norm(x, z, weight, eps):
    if z.shape == x.shape and z.dtype == x.dtype and can_run_native(x, weight):
        return gated_rms_norm_native(x, z, weight, eps)
    return reference.gated_rms_norm_torch(x, z, weight, eps)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    if can_run_qk_norm_rope(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_native(q, k, q_weight, k_weight, eps, cos, sin)
    return reference.qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin)
