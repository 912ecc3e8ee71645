"""Per-token reference for the gated delta rule: the recurrence written out, one token at a time.

Slow on purpose; the chunked and recurrent kernels are tested against it.
"""

from __future__ import annotations

import torch


def naive_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, initial_state: torch.Tensor | None = None,
                           scale: float | None = None, use_qk_l2norm: bool = True
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over one sequence.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay, <= 0), beta: [T, Hv];
    initial_state: [Hv, dk, dv] or None (zeros). Value head h uses key head h // (Hv / Hk).
    Per token, in fp32: S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q.
    Returns o: [T, Hv, dv] in v.dtype and the final state [Hv, dk, dv] float32.
    """
    T, Hk, dk = k.shape
    Hv, dv = v.shape[-2:]
    out_dtype = v.dtype
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (dk ** -0.5 if scale is None else scale)
    key_head = torch.arange(Hv, device=v.device) // (Hv // Hk)
    state = (torch.zeros(Hv, dk, dv, device=v.device) if initial_state is None
             else initial_state.float().clone())
    o = torch.empty(T, Hv, dv, device=v.device)
    for t in range(T):
        q_t, k_t = q[t, key_head], k[t, key_head]                       # [Hv, dk]
        state = state * g[t].exp()[:, None, None]                       # decay before read and write
        predicted = torch.einsum("hkv,hk->hv", state, k_t)
        u = beta[t][:, None] * (v[t] - predicted)
        state = state + k_t[:, :, None] * u[:, None, :]
        o[t] = torch.einsum("hkv,hk->hv", state, q_t)                   # read after the update
    return o.to(out_dtype), state
