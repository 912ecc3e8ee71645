"""RMSNorms and the fused q/k-norm + partial RoPE, on the triton backend.

Every kernel works on rows of the last dim, one row per program, in fp32 with the rounding
points of the torch ops (kernels/norm/reference.py, kernels/rope/reference.py) where they matter in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [R, D] with unit stride on D (a view whenever the layout allows)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm, x * rsqrt(mean(x^2) + eps) * (1 + weight); contract of the torch op."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        D = rows.shape[1]
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), D, eps,
                                           BD=triton.next_power_of_2(D))
    return out.view(x.shape)


@triton.jit
def _rms_norm_kernel(x, weight, out, sx, D, eps, BD: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BD)
    mask = offs < D
    h = tl.load(x + r * sx + offs, mask=mask, other=0.0).to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h) / D + eps)
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r * D + offs, (h * (1.0 + w)).to(out.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add, then the zero-centred RMSNorm of the sum; contract of the torch op."""
    total = x + h
    return total, rms_norm(total, weight, eps)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm, weight * rmsnorm(x) * silu(z) with a plain weight; contract of the torch op."""
    rows, gates = _rows(x), _rows(z)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel():
        D = rows.shape[1]
        # torch rounds weight * norm(x) to promote(weight, x) before the fp32 gate multiply
        mid = torch.promote_types(weight.dtype, x.dtype)
        _gated_rms_norm_kernel[(rows.shape[0],)](
            rows, gates, weight, out, rows.stride(0), gates.stride(0), D, eps,
            MID=_TL_DTYPES[mid], BD=triton.next_power_of_2(D))
    return out.view(x.shape)


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _gated_rms_norm_kernel(x, z, weight, out, sx, sz, D, eps, MID: tl.constexpr, BD: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.arange(0, BD)
    mask = offs < D
    x_row = tl.load(x + r * sx + offs, mask=mask, other=0.0)
    h = x_row.to(tl.float32)
    h = (h * tl.rsqrt(tl.sum(h * h) / D + eps)).to(x_row.dtype)
    w = tl.load(weight + offs, mask=mask, other=0.0)
    h = (h.to(tl.float32) * w.to(tl.float32)).to(MID).to(tl.float32)
    g = tl.load(z + r * sz + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + r * D + offs, (h * g * tl.sigmoid(g)).to(out.dtype.element_ty), mask=mask)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE on the first cos.shape[-1] dims of every head; contract of the torch op."""
    return _norm_rope(x, None, 0.0, cos, sin)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-centred RMSNorm over head_dim, then partial RoPE, of q [T, nh, hd] and k [T, nkv, hd]
    in one pass each; contract of the torch op (kernels/norm/reference.py)."""
    return _norm_rope(q, q_weight, eps, cos, sin), _norm_rope(k, k_weight, eps, cos, sin)


def _norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    T, H, hd = x.shape
    out = torch.empty(T, H, hd, dtype=x.dtype, device=x.device)
    if T == 0 or H == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    _norm_rope_kernel[(T, H)](
        x, x if weight is None else weight, cos, sin, out, x.stride(0), x.stride(1), eps,
        H=H, HD=hd, ROT=cos.shape[-1], BHD=triton.next_power_of_2(hd), NORM=weight is not None)
    return out


@triton.jit
def _norm_rope_kernel(x, weight, cos, sin, out, sx_t, sx_h, eps, H: tl.constexpr,
                      HD: tl.constexpr, ROT: tl.constexpr, BHD: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BHD)
    mask = offs < HD
    row = x + t * sx_t + h * sx_h
    x_row = tl.load(row + offs, mask=mask, other=0.0)
    HALF: tl.constexpr = ROT // 2
    # NeoX pairs (j, j + ROT/2): rotate_half(x)[j] = -x[j + HALF] for j < HALF, x[j - HALF] after
    rotating = offs < ROT
    partner = tl.where(offs < HALF, offs + HALF, offs - HALF)
    x_partner = tl.load(row + partner, mask=rotating, other=0.0)
    if NORM:
        # the norm's output is rounded to x.dtype before RoPE, as the torch ops do
        h32 = x_row.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(h32 * h32) / HD + eps)
        w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
        w_partner = tl.load(weight + partner, mask=rotating, other=0.0).to(tl.float32)
        x_row = (h32 * rstd * (1.0 + w)).to(x_row.dtype)
        x_partner = (x_partner.to(tl.float32) * rstd * (1.0 + w_partner)).to(x_row.dtype)
    c = tl.load(cos + t * ROT + offs, mask=rotating, other=1.0).to(tl.float32)
    s = tl.load(sin + t * ROT + offs, mask=rotating, other=0.0).to(tl.float32)
    signed_partner = tl.where(offs < HALF, -x_partner.to(tl.float32), x_partner.to(tl.float32))
    rotated = x_row.to(tl.float32) * c + signed_partner * s
    y = tl.where(rotating, rotated, x_row.to(tl.float32))
    tl.store(out + (t * H + h) * HD + offs, y.to(out.dtype.element_ty), mask=mask)
