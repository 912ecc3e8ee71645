"""Gated delta rule for decode and speculative verify, over a pool of states addressed by slot.

Each of B requests feeds T tokens (1 for decode, k+1 when verifying k drafts). The state
after every token is written to its own slot, so a verify step keeps one state per draft
position and the next step simply reads the slot of the last accepted token (no rollback copy).

Per token the state S [dk, dv] of each head is read twice and written once, so the cost is
memory traffic on S (1 MB per request per layer at Qwen3.5-0.8B dims), not arithmetic. With
S' = a S + k u^T and u = beta (v - a S^T k), the output needs no second read of S':
o = S'^T q = a S^T q + (k . q) u, so one bmm of the stacked [k; q] against S gives both reads.
The cpu backend runs decode and verify steps of any state size as one native call per layer
that reads and writes each state once per token (kernels/gdn/gdn_recurrent.cpp, through
recurrent_cpu.py); the torch forms below are its reference. Plain decode
(T = 1, every request writing back to its read slot) with large states updates each request's
state where it lives in the pool: gathering the batch into a copy and scattering it back would
add two more passes over every state, and one request's state stays in L2 between its read and
its update. Small states (tiny models) and verify steps go through the gathered copy instead,
where the per-request loop's ~3 ops per request would cost more than the copies; there the
cost is op count rather than traffic, so each token takes the naive reference's five ops
(decay, k^T S, u, rank-1 update, q^T S) instead of the single read's ten.
"""

from __future__ import annotations

import torch

from ..slot_pool import DecodeRows, scatter_to_slots
from .qk_norm import normalize_kq

# A slot state at least this large is updated in place, one request at a time.
IN_PLACE_MIN_BYTES = 256 * 1024


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state_pool: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               scale: float | None = None, use_qk_l2norm: bool = True,
                               rows: DecodeRows | None = None) -> torch.Tensor:
    """Gated delta rule for B requests of T tokens each, batched over requests and heads.

    q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g (log decay, <= 0), beta: [B, T, Hv];
    state_pool: [S, Hv, dk, dv] float32, modified in place; read_slots: [B] int64, row b starts
    from state_pool[read_slots[b]]; write_slots: [B, T] int64, the state after token t of row b
    goes to state_pool[write_slots[b, t]] (entries < 0 are skipped, e.g. padded rows).
    Every read happens before any write, so a write slot may equal a read slot (plain decode:
    T = 1, write_slots = read_slots[:, None]). Tokens are written in order, so a slot repeated
    along t keeps the last state; rows of one step must not share a write slot.
    rows: the step's DecodeRows, which choose the form (None: read back from the slots).
    Returns o: [B, T, Hv, dv] in v.dtype.
    """
    Hv = v.shape[2]
    kq = normalize_kq(q, k, Hv, scale, use_qk_l2norm)                # [B, T, Hv, 2, dk]: k, scaled q
    decay = g.float().exp()
    o = _torch_form(kq, decay, beta, v, state_pool, read_slots, write_slots,
                    rows or DecodeRows.of_tensors(read_slots, write_slots))
    return o.to(v.dtype)


def _torch_form(kq, decay, beta, v, state_pool, read_slots, write_slots, rows: DecodeRows) -> torch.Tensor:
    """-> o [B, T, Hv, dv] float32. Where the rows' slots are known as host ints and each row
    writes back to its read slot, states are updated where they live in the pool."""
    B, T, Hv, dv = v.shape
    ids = rows.read_ids if rows.in_place else None
    if ids is not None and _large(state_pool):
        kq = kq[:, 0]
        qk = (kq[:, :, 0] * kq[:, :, 1]).sum(-1)[..., None, None]        # [B, Hv, 1, 1]
        o = _decode_in_place(kq, qk, decay[:, 0, :, None, None], beta.float()[:, 0, :, None, None],
                             v.float()[:, 0, :, None, :], state_pool, ids)
        return o.view(B, 1, Hv, dv)
    # A single plain decode needs no copy at any size: its one state is updated in its slot.
    in_place_slot = ids[0] if ids is not None and B == 1 else None
    return _steps(kq, decay, beta, v, state_pool, read_slots, write_slots, in_place_slot, rows.writes_valid)


def _large(state_pool: torch.Tensor) -> bool:
    return state_pool.stride(0) * state_pool.element_size() >= IN_PLACE_MIN_BYTES


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


def _steps(kq, decay, beta, v, state_pool, read_slots, write_slots, in_place_slot=None, writes_valid=None):
    """General form: the batch's states gathered into a copy (which lets writes target read
    slots), advanced token by token in the naive reference's order (decay, read k^T S, update,
    read q^T S: fewer ops than the in-place path's single read, which pays only for large
    states), each token's state scattered to its write slots. With in_place_slot (one request,
    one token, written back to where it was read) the state is updated in the pool instead.
    writes_valid: no write slot is negative (None: checked here, a read-back)."""
    B, T, Hv, _, dk = kq.shape
    dv = v.shape[-1]
    n = B * Hv
    if in_place_slot is None:
        states = state_pool.index_select(0, read_slots)               # [B, Hv, dk, dv], what is written
        if writes_valid is None:
            writes_valid = bool((write_slots >= 0).all())
    else:
        states = state_pool[in_place_slot:in_place_slot + 1]
    state = states.view(n, dk, dv)                                    # the same memory, batched over heads
    outs = []
    for kq_t, a_t, b_t, v_t, slots in zip(_per_token(kq, n, 2, dk), _per_token(decay, n, 1, 1),
                                          _per_token(beta.float(), n, 1, 1), _per_token(v.float(), n, 1, dv),
                                          _per_token(write_slots, B)):
        k_t = kq_t[:, :1]
        state.mul_(a_t)
        u = torch.baddbmm(v_t, k_t, state, alpha=-1).mul_(b_t)
        state.baddbmm_(k_t.transpose(1, 2), u)                         # S += k u^T, u = beta (v - k^T S)
        outs.append(torch.bmm(kq_t[:, 1:], state).view(B, 1, Hv, dv))  # q^T S
        if in_place_slot is None:
            scatter_to_slots(state_pool, slots, states, writes_valid)
    return outs[0] if T == 1 else torch.cat(outs, 1)


def _per_token(x: torch.Tensor, *shape: int) -> list[torch.Tensor]:
    """x: [B, T, ...] -> T tensors, each token's slice reshaped to `shape`."""
    if x.shape[1] == 1:
        return [x.reshape(shape)]
    # reshape even where the shape is already right: comparing symbolic shapes under
    # torch.compile would specialise on batch size 1
    return [x_t.reshape(shape) for x_t in x.unbind(1)]
