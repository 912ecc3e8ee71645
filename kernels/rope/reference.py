"""Partial NeoX-style rotary embedding (Qwen3.5 rotates the first 25% of head_dim).

For text-only inputs Qwen3.5's interleaved mRoPE has equal T/H/W positions and reduces
exactly to this 1-D form with position = absolute token index.
"""

from __future__ import annotations

import functools

import torch


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables: each [T, rotary_dim], computed in fp32 and cast to dtype.

    positions: [T] int. inv_freq = 1 / theta ** (arange(0, rot, 2) / rot); dims j and j + rot/2
    share frequency j (so cos = cat(cos(f), cos(f))).
    """
    freqs = positions.float()[:, None] * _inv_freq(rotary_dim, theta, positions.device)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


@functools.lru_cache(maxsize=8)
def _inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    # Built once per config and device: a decode step would otherwise spend more ops on this
    # constant than on the tables themselves. Made outside inference mode, so that a cached
    # table stays usable from every mode.
    with torch.inference_mode(False):
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float()
        return 1.0 / (theta ** (exponent / rotary_dim))


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of every head; the rest pass through unchanged.

    x: [T, H, hd]; cos, sin: [T, rotary_dim] (rotary_dim <= hd, even). Pairs (j, j + rot/2)
    rotate together (rotate_half(x) = cat(-x2, x1)), not adjacent pairs as in GPT-J.
    Returns [T, H, hd] in x.dtype.
    """
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)
