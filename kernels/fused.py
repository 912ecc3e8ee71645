"""Fused entry points' torch references: compositions of the plain ops.

The triton backend runs each of these as one kernel (kernels/triton/); here they are the
plain ops in sequence, so both backends share one contract and one test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .cpu.rms_norm import can_run_qk_norm_rope, qk_norm_rope_native
from .gdn import recurrent_gated_delta_rule
from .norm import rms_norm_torch
from .rope import apply_partial_rope
from .slot_pool import DecodeRows


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention q/k prep: zero-centred RMSNorm over head_dim, then partial NeoX RoPE.

    q: [T, nh, hd]; k: [T, nkv, hd] (same dtype); q_weight, k_weight: [hd]; cos, sin: [T, rotary_dim].
    Returns (q, k) in their input dtypes.

    On CPU, where the native kernel runs (kernels/cpu/rms_norm.cpp, an eager call), the call is
    that kernel; the torch form below serves everywhere else and is its reference.
    """
    if can_run_qk_norm_rope(q, k, q_weight, k_weight, cos, sin):
        return qk_norm_rope_native(q, k, q_weight, k_weight, eps, cos, sin)
    return qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin)


def qk_norm_rope_torch(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """qk_norm_rope in torch ops (the same contract).

    q and k go through the plain ops as one [T, nh + nkv, hd] tensor, each head with its own
    weight: the same per-row arithmetic (bitwise equal to the ops applied to each), in half
    the calls.
    """
    nh, nkv = q.shape[1], k.shape[1]
    weight = torch.cat([q_weight.expand(nh, -1), k_weight.expand(nkv, -1)])
    qk = apply_partial_rope(rms_norm_torch(torch.cat([q, k], dim=1), weight, eps), cos, sin)
    return qk[:, :nh], qk[:, nh:]


def recurrent_gated_delta_rule_fused_gating(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
                                            dt_bias: torch.Tensor, state_pool: torch.Tensor,
                                            read_slots: torch.Tensor, write_slots: torch.Tensor,
                                            scale: float | None = None, use_qk_l2norm: bool = True,
                                            rows: DecodeRows | None = None) -> torch.Tensor:
    """recurrent_gated_delta_rule with the gates computed from the raw projections, in fp32:
    g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b).

    a, b: [B, T, Hv]; A_log, dt_bias: [Hv]; everything else as recurrent_gated_delta_rule.
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    beta = torch.sigmoid(b.float())
    return recurrent_gated_delta_rule(q, k, v, g, beta, state_pool, read_slots, write_slots,
                                      scale, use_qk_l2norm, rows)
