"""The GDN layer's decode step (kernels/fused.py `gdn_decode`'s contract) on the triton backend:
the gates in torch ops, then this backend's conv update and recurrent kernels, as the layer
composed them before the CPU op fused the step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import causal_conv1d_update
from .gdn import recurrent_gated_delta_rule


def gdn_decode(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
               dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor, conv_pool: torch.Tensor,
               state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
               scale: float | None = None, rows=None) -> torch.Tensor:
    B, T, _ = mixed.shape
    _, hv, dk, dv = state_pool.shape
    key_dim = (mixed.shape[-1] - hv * dv) // 2
    beta = torch.sigmoid(b)                                       # activation dtype, as HF
    g = neg_decay_rate * F.softplus(a.float() + dt_bias.float())
    u = causal_conv1d_update(mixed, conv_weight, conv_pool, read_slots, write_slots, rows)
    q, k, v = u.split([key_dim, key_dim, hv * dv], dim=-1)
    return recurrent_gated_delta_rule(q.view(B, T, -1, dk), k.view(B, T, -1, dk), v.view(B, T, hv, dv), g, beta,
                                      state_pool, read_slots, write_slots, scale, rows=rows)
