"""Gated delta rule for decode and speculative verify, over a pool of states addressed by slot.

Each of B requests feeds T tokens (1 for decode, k+1 when verifying k drafts). The state
after every token is written to its own slot, so a verify step keeps one state per draft
position and the next step simply reads the slot of the last accepted token (no rollback copy).

Per token the state S [dk, dv] of each head is read twice and written once, so the cost is
memory traffic on S (1 MB per request per layer at Qwen3.5-0.8B dims), not arithmetic. With
S' = a S + k u^T and u = beta (v - a S^T k), the output needs no second read of S':
o = S'^T q = a S^T q + (k . q) u, so one bmm of the stacked [k; q] against S gives both reads.
Plain decode (T = 1, every request writing back to its read slot) with large states updates
each request's state where it lives in the pool: gathering the batch into a copy and
scattering it back would add two more passes over every state, and one request's state stays
in L2 between its read and its update. Small states (tiny models) go through the gathered
copy instead, where the per-request loop's ~3 ops per request would cost more than the copies.
"""

from __future__ import annotations

import torch

from .qk_norm import normalize_kq

# A slot state at least this large is updated in place, one request at a time.
IN_PLACE_MIN_BYTES = 256 * 1024


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
    kq = normalize_kq(q, k, Hv, scale, use_qk_l2norm)                # [B, T, Hv, 2, dk]: k, scaled q
    qk = (kq[..., 0, :] * kq[..., 1, :]).sum(-1)[..., None, None]      # [B, T, Hv, 1, 1]
    decay = g.float().exp()[..., None, None]
    beta = beta.float()[..., None, None]
    vf = v.float()[..., None, :]                                       # [B, T, Hv, 1, dv]
    if T == 1 and state_pool.stride(0) * state_pool.element_size() >= IN_PLACE_MIN_BYTES:
        read = read_slots.tolist()
        if write_slots.view(-1).tolist() == read:
            o = _decode_in_place(kq[:, 0], qk[:, 0], decay[:, 0], beta[:, 0], vf[:, 0], state_pool, read)
            return o.view(B, 1, Hv, dv).to(v.dtype)
    return _steps(kq, qk, decay, beta, vf, state_pool, read_slots, write_slots).to(v.dtype)


def _decode_in_place(kq, qk, decay, beta, v, state_pool, slots):
    """One token per request, state updated in its own slot. kq [B, Hv, 2, dk]; the rest [B, Hv, ...]."""
    B, Hv, _, dk = kq.shape
    states = [state_pool[s] for s in slots]                             # views into the pool
    reads = kq.new_empty(B, Hv, 2, v.shape[-1])
    for b in range(B):
        torch.bmm(kq[b], states[b], out=reads[b])                       # k^T S and q^T S
    u = (v - decay * reads[:, :, :1]) * beta                            # [B, Hv, 1, dv]
    o = torch.addcmul(decay * reads[:, :, 1:], qk, u)
    k_col = kq[:, :, :1].transpose(-1, -2)                              # [B, Hv, dk, 1]
    for b in range(B):
        states[b].mul_(decay[b]).baddbmm_(k_col[b], u[b])               # S = a S + k u^T
    return o


def _steps(kq, qk, decay, beta, v, state_pool, read_slots, write_slots):
    """General form: the batch's states gathered into a copy (which lets writes target read
    slots), advanced token by token, each token's state scattered to its write slots."""
    B, T, Hv, _, dk = kq.shape
    dv = v.shape[-1]
    n = B * Hv
    state = state_pool.index_select(0, read_slots).view(n, dk, dv)
    o = kq.new_empty(B, T, Hv, dv)
    for t in range(T):                                                 # T is 1 or a few drafts
        kq_t, a = kq[:, t].reshape(n, 2, dk), decay[:, t].reshape(n, 1, 1)
        reads = torch.bmm(kq_t, state)
        u = (v[:, t].reshape(n, 1, dv) - a * reads[:, :1]) * beta[:, t].reshape(n, 1, 1)
        o[:, t] = torch.addcmul(a * reads[:, 1:], qk[:, t].reshape(n, 1, 1), u).view(B, Hv, dv)
        state.mul_(a).baddbmm_(kq_t[:, :1].transpose(1, 2), u)
        slots = write_slots[:, t]
        keep = slots >= 0
        if bool(keep.all()):
            state_pool.index_copy_(0, slots, state.view(B, Hv, dk, dv))
        else:
            state_pool[slots[keep]] = state.view(B, Hv, dk, dv)[keep]
    return o
