"""Query/key preparation shared by the chunked and recurrent GDN kernels."""

from __future__ import annotations

import functools

import torch

from ..norm.reference import scalar


def normalize_qk(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None,
                 use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 l2norm (optional) and scaling of q, then expansion of q and k to the value heads.

    q, k: [..., Hk, dk] in any float dtype. Returns q, k: [..., Hv, dk] float32, where value
    head h uses key head h // (Hv / Hk) (repeat_interleave: consecutive value heads share a key
    head; tiling would be h % Hk and is wrong for Qwen3.5).
    """
    dk = k.shape[-1]
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        # eps inside the rsqrt of the sum, as fla and transformers do
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    q = q * (dk ** -0.5 if scale is None else scale)
    groups = num_v_heads // k.shape[-2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=-2)
        k = k.repeat_interleave(groups, dim=-2)
    return q, k


def normalize_kq(q: torch.Tensor, k: torch.Tensor, num_v_heads: int, scale: float | None,
                 use_qk_l2norm: bool) -> torch.Tensor:
    """normalize_qk's result stacked as one tensor [..., Hv, 2, dk] float32: row 0 is k, row 1
    is q (scaled), so one matmul against the state reads both k^T S and q^T S. The scale is
    folded into q's l2norm factor (as the chunk kernel does): one multiply for both rows."""
    kq = torch.stack([k, q], dim=-2).float()                          # [..., Hk, 2, dk]
    factor = _kq_scale(k.shape[-1] ** -0.5 if scale is None else scale, kq.device)   # [2, 1]
    if use_qk_l2norm:
        # eps inside the rsqrt of the sum, as fla and transformers do
        factor = kq.square().sum(-1, keepdim=True).add_(scalar(1e-6, kq.device)).rsqrt_().mul_(factor)
    kq = kq * factor
    groups = num_v_heads // k.shape[-2]
    if groups > 1:
        kq = kq.repeat_interleave(groups, dim=-3)
    return kq


@functools.lru_cache(maxsize=8)
def _kq_scale(scale: float, device: torch.device) -> torch.Tensor:
    """[[1], [scale]]: k's and q's factors. Filled on the device (no host copy, so that a CUDA
    graph capture may build it) and outside inference mode (usable from every mode)."""
    with torch.inference_mode(False):
        factor = torch.ones(2, 1, device=device)
        factor[1] = scale
        return factor
