"""The two RMSNorm conventions of Qwen3.5 (deliberately mixed in the model)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + weight).

    x: [..., D]; weight: [D] (stored as an offset from 1, init 0). All in fp32 with a single
    cast back to x.dtype (input, post-attention, final, q/k and MTP norms).
    """
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm over the last dim: weight * rmsnorm(x) * silu(z), PLAIN weight (init 1).

    x, z: [..., D]; weight: [D]. The normalised x is cast to x.dtype before the weight multiply
    and silu(z) is applied in fp32, as transformers does; the bf16 rounding points matter.
    """
    h = x.float()
    h = h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    h = h * F.silu(z.float())
    return h.to(x.dtype)
