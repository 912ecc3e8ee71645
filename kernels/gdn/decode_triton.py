"""The GDN layer's decode step (kernels/gdn/decode.py `gdn_decode`'s contract) on the triton backend:
the gates in torch ops, then this backend's conv update and recurrent kernels, as the layer
composed them before the CPU op fused the step."""

from __future__ import annotations

import torch

from ..conv.triton import causal_conv1d_update
from .decode import composed_gdn_decode
from .triton import recurrent_gated_delta_rule


def gdn_decode(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
               dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor, conv_pool: torch.Tensor,
               state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
               scale: float | None = None, rows=None) -> torch.Tensor:
    return composed_gdn_decode(causal_conv1d_update, recurrent_gated_delta_rule, mixed, b, a, conv_weight, dt_bias,
                               neg_decay_rate, conv_pool, state_pool, read_slots, write_slots, scale, rows)
