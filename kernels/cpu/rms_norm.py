"""Qwen3.5's RMSNorms with the native kernel rms_norm.cpp, one call each instead of the torch
forms' 8 to 25 ops: the zero-centred norm (kernels/norm.py `rms_norm_torch`), the same after the
residual add before it (`add_rms_norm_torch`), the GDN output's gated norm
(`gated_rms_norm_torch`) and the attention q/k norm with its partial RoPE (kernels/fused.py
`qk_norm_rope_torch`). Those are the references, and the forms taken wherever these cannot run.

Eager calls only: a function torch.compile traces keeps the torch forms, which inductor fuses
into its own kernels (and a ctypes call would break its graph)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library

SOURCE = Path(__file__).with_name("rms_norm.cpp")
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 1024          # the kernel's q/k row buffer
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
_ARGS = {
    "rms_norm": [_P] * 3 + [_I] * 3 + [_I64] * 2 + [_F, _I],
    "add_rms_norm": [_P] * 5 + [_I] * 2 + [_I64] * 2 + [_F, _I],
    "gated_rms_norm": [_P] * 4 + [_I] * 3 + [_I64] * 4 + [_F, _I],
    "qk_norm_rope": [_P] * 7 + [_I] * 5 + [_I64] * 5 + [_F, _I],
}


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
    return _library(None) is not None


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float, level: str | None = None) -> torch.Tensor:
    """x [..., D] (last dim contiguous) -> x * rsqrt(mean(x^2) + eps) * (1 + weight), x.dtype.
    level: the kernel built for that level of kernels/cpu/isa.py (None: this process's; tests
    run each level below it)."""
    D = x.shape[-1]
    rows = x if x.dim() == 2 else x.reshape(-1, D)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = _empty_like(x)
    if y.numel():
        _entry("rms_norm", x.dtype, weight.dtype, level)(
            rows.data_ptr(), _contiguous(weight).data_ptr(), y.data_ptr(), rows.shape[0], 1, D,
            rows.stride(0), 0, eps, torch.get_num_threads())
    return y


def add_rms_norm_native(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float,
                        level: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, h [..., D] of one dtype -> (x + h, its zero-centred norm), both x.dtype."""
    D = x.shape[-1]
    xr, hr = _rows(x, D), _rows(h, D)
    total, y = _empty_like(x), _empty_like(x)
    if y.numel():
        _entry("add_rms_norm", x.dtype, weight.dtype, level)(
            xr.data_ptr(), hr.data_ptr(), _contiguous(weight).data_ptr(), total.data_ptr(), y.data_ptr(),
            xr.shape[0], D, xr.stride(0), hr.stride(0), eps, torch.get_num_threads())
    return total, y


def gated_rms_norm_native(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                          level: str | None = None) -> torch.Tensor:
    """x, z [..., D] of one dtype (z may be a strided slice) -> weight * rmsnorm(x) * silu(z)
    with a PLAIN weight, x.dtype (the reference's rounding points)."""
    D = x.shape[-1]
    xr, zr = _heads(x, D), _heads(z, D)
    y = _empty_like(x)
    if y.numel():
        _entry("gated_rms_norm", x.dtype, weight.dtype, level)(
            xr.data_ptr(), zr.data_ptr(), _contiguous(weight).data_ptr(), y.data_ptr(), xr.shape[0],
            xr.shape[1], D, xr.stride(0), xr.stride(1), zr.stride(0), zr.stride(1), eps, torch.get_num_threads())
    return y


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
    T, nh, hd = q.shape
    nkv = k.shape[1]
    out = q.new_empty(T, nh + nkv, hd)
    if T and hd:
        cos, sin = _contiguous(cos), _contiguous(sin)
        _entry("qk_norm_rope", q.dtype, q_weight.dtype, level)(
            q.data_ptr(), k.data_ptr(), _contiguous(q_weight).data_ptr(),
            _contiguous(k_weight).data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
            T, nh, nkv, hd, cos.shape[-1], q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            eps, torch.get_num_threads())
    return out[:, :nh], out[:, nh:]


def _empty_like(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor of t's shape, dtype and device (the cheapest allocation from Python)."""
    return torch.empty_like(t, memory_format=torch.contiguous_format)


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _rows(t: torch.Tensor, D: int) -> torch.Tensor:
    """[..., D] -> [R, D], rows at one stride, the last dim contiguous (a view where it can be)."""
    rows = t if t.dim() == 2 else t.reshape(-1, D)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _heads(t: torch.Tensor, D: int) -> torch.Tensor:
    """[..., D] -> [R0, R1, D] (tokens, heads), the last dim contiguous (a view where it can be)."""
    if t.dim() == 3:
        heads = t
    elif t.dim() < 3:
        heads = t.reshape(-1, 1, D)
    else:
        heads = t.reshape(-1, t.shape[-2], D)
    return heads if heads.stride(-1) == 1 else heads.contiguous()


@functools.lru_cache(maxsize=None)
def _library(level: str | None) -> ctypes.CDLL | None:
    return load_library(SOURCE, level)


@functools.lru_cache(maxsize=None)
def _entry(kind: str, x_dtype: torch.dtype, w_dtype: torch.dtype, level: str | None):
    """The kernel's entry point for (kind, activation dtype, weight dtype)."""
    lib = _library(level)
    if lib is None or x_dtype not in DTYPES or w_dtype not in DTYPES:
        raise ValueError(f"rms_norm native: no {kind} kernel for {x_dtype}, weight {w_dtype} at level {level}")
    fn = getattr(lib, f"{kind}_{_SUFFIX[x_dtype]}_{_SUFFIX[w_dtype]}")
    fn.argtypes, fn.restype = _ARGS[kind], None
    return fn
