"""The two RMSNorm conventions of Qwen3.5 (deliberately mixed in the model), and the attention
q/k norm + partial RoPE, in torch ops.

These are the references (the `torch` backend's ops). The `cpu` backend's native forms
(rms_norm.cpp, through cpu.py) match them to an ulp of float32 (their sum of squares runs in its
own order), not bitwise; the triton ones are triton.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..rope import apply_partial_rope


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + weight).

    x: [..., D]; weight: [D] (stored as an offset from 1, init 0). All in fp32 with a single
    cast back to x.dtype (input, post-attention, final, q/k and MTP norms). This form also
    takes a weight of any shape that broadcasts against x; the native and triton ops take [D].
    """
    h = x.float()
    h = h * _inv_rms(h, eps)
    return h.mul_(weight.float() + scalar(1.0, h.device)).to(x.dtype)


def add_rms_norm_torch(x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (x + h, rms_norm(x + h, weight, eps)).

    x, h: [..., D] of one dtype; weight: [D]. The sum is rounded to x.dtype before the norm
    reads it, as the two ops in sequence would.
    """
    total = x + h
    return total, rms_norm_torch(total, weight, eps)


def gated_rms_norm_torch(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm over the last dim: weight * rmsnorm(x) * silu(z), PLAIN weight (init 1).

    x, z: [..., D]; weight: [D]. The normalised x is cast to x.dtype before the weight multiply
    and silu(z) is applied in fp32, as transformers does; the bf16 rounding points matter.
    """
    h = x.float()
    h = h * _inv_rms(h, eps)
    h = weight * h.to(x.dtype)
    h = h * F.silu(z.float())
    return h.to(x.dtype)


def qk_norm_rope_torch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention q/k prep: zero-centred RMSNorm over head_dim, then partial NeoX RoPE.

    q: [T, nh, hd]; k: [T, nkv, hd] (same dtype); q_weight, k_weight: [hd]; cos, sin: [T, rotary_dim].
    Returns (q, k) in their input dtypes.

    q and k go through the plain ops as one [T, nh + nkv, hd] tensor, each head with its own
    weight: the same per-row arithmetic (bitwise equal to the ops applied to each), in half
    the calls.
    """
    nh, nkv = q.shape[1], k.shape[1]
    weight = torch.cat([q_weight.expand(nh, -1), k_weight.expand(nkv, -1)])
    qk = apply_partial_rope(rms_norm_torch(torch.cat([q, k], dim=1), weight, eps), cos, sin)
    return qk[:, :nh], qk[:, nh:]


def _inv_rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    """rsqrt(mean(h^2) + eps) over the last dim, bitwise as written (mean is a sum and a
    division by D), in three ops with no Python scalar operand."""
    d = h.device
    return torch.addcdiv(scalar(eps, d), h.square().sum(-1, keepdim=True), scalar(h.shape[-1], d)).rsqrt_()


@functools.lru_cache(maxsize=64)
def scalar(value: float, device: torch.device) -> torch.Tensor:
    """A 0-dim float32 tensor holding value, made once. An op with a Python number operand
    first wraps it in a fresh tensor, which at decode sizes costs more than the op itself.
    Filled on the device (no host copy: a CUDA graph capture may build it) and outside
    inference mode, so that it serves every mode."""
    with torch.inference_mode(False):
        return torch.full((), value, dtype=torch.float32, device=device)
