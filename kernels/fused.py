"""Fused entry points' torch references: compositions of the plain ops.

The triton backend runs each of these as one kernel (kernels/triton/); here they are the
plain ops in sequence, so both backends share one contract and one test.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .conv import causal_conv1d_update
from .cpu import gdn_decode as native_gdn_decode
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


def gdn_decode(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
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
    in mixed.dtype.

    On CPU, where the native kernels run (kernels/cpu/gdn_decode.py), the call is one op, in eager
    steps and compiled graphs alike; the torch form below serves everywhere else and is its
    reference.
    """
    dk = state_pool.shape[2]
    scale = dk ** -0.5 if scale is None else scale
    if (native_gdn_decode.can_run_native(mixed, b, a, conv_weight, conv_pool, state_pool)
            and (rows is None or rows.independent)):
        return native_gdn_decode.gdn_decode_op(mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate,
                                               state_pool, read_slots, write_slots, scale)
    return gdn_decode_torch(mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_pool, state_pool,
                            read_slots, write_slots, scale, rows)


def decode_kernel_serves_prefill(conv_pool: torch.Tensor, state_pool: torch.Tensor, dtype: torch.dtype,
                                 conv_kernel_size: int) -> bool:
    """Whether gdn_decode should also run prefill segments, token by token (their GDN state
    written only at the end and at checkpoints): where its native CPU kernel serves the layer
    (pools as the cache holds them, activations of `dtype`). There it beats the chunked form at
    every length measured, with the same result to float32 rounding (AMD EPYC, 2 threads, one
    layer, eager: the default model's dims 25-81 us against 417-628 us for 4-128 tokens; 0.8B
    dims 1.1 ms against 2.3 ms at 64 tokens, 8.0 against 17.8 ms at 512, AVX2 12.6 against 20.8):
    the chunked form's ~40 torch ops and its triangular solves cost more than the recurrence's
    two passes over each state per token. Elsewhere (torch, triton) the torch form of gdn_decode
    would loop over the tokens: prefill stays chunked."""
    hv, conv_dim = state_pool.shape[1], conv_pool.shape[1]
    mixed = torch.empty(1, 1, conv_dim, dtype=dtype, device=conv_pool.device)
    gates = torch.empty(1, 1, hv, dtype=dtype, device=conv_pool.device)
    weight = torch.empty(conv_dim, conv_kernel_size, dtype=dtype, device=conv_pool.device)
    return native_gdn_decode.can_run_native(mixed, gates, gates, weight, conv_pool, state_pool)


def gdn_decode_torch(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                     dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor, conv_pool: torch.Tensor,
                     state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
                     scale: float | None = None, rows: DecodeRows | None = None) -> torch.Tensor:
    """gdn_decode as the plain ops in sequence (the same contract)."""
    return composed_gdn_decode(causal_conv1d_update, recurrent_gated_delta_rule, mixed, b, a, conv_weight, dt_bias,
                               neg_decay_rate, conv_pool, state_pool, read_slots, write_slots, scale, rows)


def composed_gdn_decode(conv_update, delta_rule, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                        conv_weight: torch.Tensor, dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor,
                        conv_pool: torch.Tensor, state_pool: torch.Tensor, read_slots: torch.Tensor,
                        write_slots: torch.Tensor, scale: float | None = None,
                        rows: DecodeRows | None = None) -> torch.Tensor:
    """gdn_decode composed of a backend's conv update and recurrent rule (the torch form's, or the
    triton backend's: kernels/triton/gdn_decode.py), the gates in torch ops."""
    B, T, _ = mixed.shape
    _, hv, dk, dv = state_pool.shape
    key_dim = (mixed.shape[-1] - hv * dv) // 2
    beta = torch.sigmoid(b)                                       # activation dtype, as HF
    g = neg_decay_rate * F.softplus(a.float() + dt_bias.float())
    u = conv_update(mixed, conv_weight, conv_pool, read_slots, write_slots, rows)
    q, k, v = u.split([key_dim, key_dim, hv * dv], dim=-1)
    return delta_rule(q.view(B, T, -1, dk), k.view(B, T, -1, dk), v.view(B, T, hv, dv), g, beta,
                      state_pool, read_slots, write_slots, scale, rows=rows)
