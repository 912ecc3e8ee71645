"""The GDN layer's decode step (gdn_decode), torch reference: a composition of the plain ops.

The cpu backend runs it as one native op where it can (decode_cpu.py), the triton backend as its
own conv update and recurrent kernels (decode_triton.py); here they are the plain ops in
sequence, so the backends share one contract and one test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..conv import causal_conv1d_update_torch
from ..slot_pool import DecodeRows
from .recurrent import recurrent_gated_delta_rule


def gdn_decode_torch(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                     dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor, conv_pool: torch.Tensor,
                     state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
                     scale: float | None = None, rows: DecodeRows | None = None) -> torch.Tensor:
    """The GDN layer's decode and verify segments from its projections: the conv update (+SiLU)
    of mixed, then the gated delta rule on its q, k, v with the gates computed from b and a
    (beta = sigmoid(b) in the activations' dtype, g = neg_decay_rate * softplus(a + dt_bias) in
    fp32), q and k l2-normed and q scaled (dk^-0.5 by default).

    mixed: [B, T, conv_dim] pre-conv q|k|v (head-major; conv_dim = 2 Hk dk + Hv dv); b, a:
    [B, T, Hv], mixed's dtype; conv_weight: [conv_dim, K]; dt_bias: [Hv]; neg_decay_rate: [Hv]
    fp32 (-exp(A_log)); conv_pool [S, conv_dim, K-1] and state_pool [S, Hv, dk, dv] fp32,
    modified in place; slots and rows as recurrent_gated_delta_rule. Returns o: [B, T, Hv, dv]
    in mixed.dtype. The plain ops in sequence.
    """
    return composed_gdn_decode(causal_conv1d_update_torch, recurrent_gated_delta_rule, mixed, b, a, conv_weight, dt_bias,
                               neg_decay_rate, conv_pool, state_pool, read_slots, write_slots, scale, rows)


def composed_gdn_decode(conv_update, delta_rule, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                        conv_weight: torch.Tensor, dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor,
                        conv_pool: torch.Tensor, state_pool: torch.Tensor, read_slots: torch.Tensor,
                        write_slots: torch.Tensor, scale: float | None = None,
                        rows: DecodeRows | None = None) -> torch.Tensor:
    """gdn_decode composed of a backend's conv update and recurrent rule (the torch form's, or the
    triton backend's: kernels/gdn/decode_triton.py), the gates in torch ops."""
    B, T, _ = mixed.shape
    _, hv, dk, dv = state_pool.shape
    key_dim = (mixed.shape[-1] - hv * dv) // 2
    beta = torch.sigmoid(b)                                       # activation dtype, as HF
    g = neg_decay_rate * F.softplus(a.float() + dt_bias.float())
    u = conv_update(mixed, conv_weight, conv_pool, read_slots, write_slots, rows)
    q, k, v = u.split([key_dim, key_dim, hv * dv], dim=-1)
    return delta_rule(q.view(B, T, -1, dk), k.view(B, T, -1, dk), v.view(B, T, hv, dv), g, beta,
                      state_pool, read_slots, write_slots, scale, rows=rows)
