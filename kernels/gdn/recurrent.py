"""Gated delta rule for decode and speculative verify, over a pool of states addressed by slot.

Each of B requests feeds T tokens (1 for decode, k+1 when verifying k drafts). The state
after every token is written to its own slot, so a verify step keeps one state per draft
position and the next step simply reads the slot of the last accepted token (no rollback copy).
"""

from __future__ import annotations

import torch

from ..slot_pool import scatter_to_slots
from .qk_norm import normalize_qk


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state_pool: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               scale: float | None = None, use_qk_l2norm: bool = True
                               ) -> torch.Tensor:
    """Gated delta rule for B requests of T tokens each, batched over requests and heads.

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g (log decay, <= 0), beta: [B, T, Hv];
    state_pool: [S, Hv, dk, dv] float32, modified in place; read_slots: [B] int64, row b starts
    from state_pool[read_slots[b]]; write_slots: [B, T] int64, the state after token t of row b
    goes to state_pool[write_slots[b, t]] (entries < 0 are skipped, e.g. padded rows).
    Every read happens before any write, so a write slot may equal a read slot (plain decode:
    T = 1, write_slots = read_slots[:, None]). Tokens are written in order, so a slot repeated
    along t keeps the last state; rows of one step must not share a write slot.
    Returns o: [B, T, Hv, dv] in v.dtype.
    """
    B, T, Hv, dv = v.shape
    dk = k.shape[-1]
    out_dtype = v.dtype
    q, k = normalize_qk(q, k, Hv, scale, use_qk_l2norm)                # [B, T, Hv, dk]
    decay = g.float().exp()
    beta = beta.float()
    v = v.float()
    # The gather copies, which is what lets the writes below target the read slots.
    state = state_pool[read_slots].view(B * Hv, dk, dv)
    o = torch.empty(B, T, Hv, dv, device=v.device)
    for t in range(T):                                                 # T is 1 or a few drafts
        k_t = k[:, t].reshape(B * Hv, 1, dk)
        state.mul_(decay[:, t].reshape(B * Hv, 1, 1))
        u = beta[:, t].reshape(B * Hv, 1, 1) * (v[:, t].reshape(B * Hv, 1, dv) - k_t @ state)
        state.baddbmm_(k_t.transpose(1, 2), u)                         # S += k u^T
        o[:, t] = (q[:, t].reshape(B * Hv, 1, dk) @ state).view(B, Hv, dv)
        scatter_to_slots(state_pool, write_slots[:, t], state.view(B, Hv, dk, dv))
    return o.to(out_dtype)

