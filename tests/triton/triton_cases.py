"""Shared inputs for the triton-vs-torch tests (float32, tiny shapes)."""

from __future__ import annotations

import torch

from hybrid_engine import kernels

TORCH = {name: getattr(kernels, name).torch_op for name in (
    "apply_partial_rope", "causal_conv1d_update", "causal_conv1d_varlen", "chunk_gated_delta_rule",
    "gated_rms_norm", "paged_attention", "qk_norm_rope", "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_fused_gating", "rms_norm", "write_kv_cache")}


def cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)


def gdn_inputs(T, Hk=2, Hv=4, dk=16, dv=8, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, dk, generator=gen)
    k = torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    g = -4 * torch.rand(T, Hv, generator=gen)
    g[torch.rand(T, Hv, generator=gen) < 0.1] = -20.0
    beta = torch.rand(T, Hv, generator=gen)
    return tuple(x.to(device) for x in (q, k, v, g, beta))
