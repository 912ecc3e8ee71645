"""Gated DeltaNet on the triton backend: fla's chunked prefill and our own slot-pool decode.

Prefill goes through fla's `chunk_gated_delta_rule` (varlen, grouped value heads). Decode
and speculative verify run `_recurrent_kernel`: one program per (request, value head, value
block) keeps its [dk, BV] slice of the state in registers across the request's 1..k+1
tokens and stores the state after every token into that token's write slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_support.common import check_private_write_slots, contiguous_last


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor,
                           initial_state: torch.Tensor, scale: float | None = None,
                           use_qk_l2norm: bool = True, chunk_size: int = 64, layout=None,
                           capture_pool: torch.Tensor | None = None,
                           capture_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the torch op (see kernels/gdn/chunk.py); fla's chunk size is fixed at 64
    and fla lays out its chunks itself, so of the ChunkLayout only the cuts are read.

    With cuts (states to capture inside the sequences), the sequences are split at them and
    fla runs once per round: round r takes the r-th piece of every sequence that has one, from
    the final states of round r - 1. That is exact (the state at a cut is a piece's final
    state) and costs one fla call per cut of the most-cut sequence, usually one or two."""
    T, Hv, dv = v.shape
    if T == 0:
        return v.new_empty(0, Hv, dv), initial_state.float().clone()
    cuts = layout.cuts if layout is not None and capture_pool is not None else None
    if cuts is None:
        return _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state.float(), scale, use_qk_l2norm)
    starts = [0]
    for n in layout.lengths:
        starts.append(starts[-1] + n)
    pieces = [[0, *c] + ([] if c and c[-1] == n else [n]) for c, n in zip(cuts, layout.lengths)]
    capture_of, next_capture = {}, 0                    # (sequence, piece end) -> capture number
    for i, c in enumerate(cuts):
        for end in c:
            capture_of[i, end], next_capture = next_capture, next_capture + 1
    state = initial_state.float().clone()
    o = v.new_empty(T, Hv, dv)
    for r in range(max(len(p) - 1 for p in pieces)):
        seqs = [i for i, p in enumerate(pieces) if len(p) - 1 > r and p[r + 1] > p[r]]
        if not seqs:
            continue
        rows = torch.cat([torch.arange(starts[i] + pieces[i][r], starts[i] + pieces[i][r + 1]) for i in seqs])
        rows = rows.to(v.device)
        cu = [0]
        for i in seqs:
            cu.append(cu[-1] + pieces[i][r + 1] - pieces[i][r])
        seq_t = torch.tensor(seqs, device=v.device)
        o_r, final_r = _fla_chunk(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                  torch.tensor(cu, dtype=torch.int64, device=v.device), state[seq_t],
                                  scale, use_qk_l2norm)
        o[rows] = o_r
        state[seq_t] = final_r
        taken = [(j, capture_of[i, pieces[i][r + 1]]) for j, i in enumerate(seqs) if (i, pieces[i][r + 1]) in capture_of]
        if taken:
            j_t = torch.tensor([j for j, _ in taken], device=v.device)
            ids = torch.tensor([c for _, c in taken], device=v.device)
            capture_pool.index_copy_(0, capture_slots[ids], final_r[j_t].to(capture_pool.dtype))
    return o, state


def _fla_chunk(q, k, v, g, beta, cu_seqlens, initial_state, scale, use_qk_l2norm):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    o, final_state = fla_chunk(
        q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=g.float().unsqueeze(0),
        beta=beta.unsqueeze(0), scale=scale, initial_state=initial_state,
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm, cu_seqlens=cu_seqlens)
    return o[0].to(v.dtype), final_state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, state_pool: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               scale: float | None = None, use_qk_l2norm: bool = True, rows=None
                               ) -> torch.Tensor:
    """Same contract as the torch op (kernels/gdn/recurrent.py; one form, so no DecodeRows), with one precondition the
    torch op does not need: a row's write slots are not another row's read slot (programs
    run concurrently). The engine's slots are private to a request, so this always holds;
    it is checked on CPU tensors and when HYBRID_ENGINE_KERNEL_CHECKS=1.
    """
    return _launch(q, k, v, state_pool, read_slots, write_slots, scale, use_qk_l2norm,
                   g=g, beta=beta)


def _launch(q, k, v, state_pool, read_slots, write_slots, scale, use_qk_l2norm, g=None, beta=None,
            a=None, b=None, A_log=None, dt_bias=None) -> torch.Tensor:
    B, T, Hv, dv = v.shape
    Hk, dk = k.shape[-2:]
    o = torch.empty(B, T, Hv, dv, dtype=v.dtype, device=v.device)
    if B == 0 or T == 0:
        return o
    check_private_write_slots(read_slots, write_slots)
    assert state_pool.is_contiguous() and state_pool.shape[1:] == (Hv, dk, dv)
    q, k, v = contiguous_last(q), contiguous_last(k), contiguous_last(v)
    fused = g is None
    gate_a, gate_b = (a, b) if fused else (g, beta)
    gate_a, gate_b = gate_a.contiguous(), gate_b.contiguous()
    A_log = A_log.contiguous() if fused else gate_a                 # unused when not fused
    dt_bias = dt_bias.contiguous() if fused else gate_a
    BV = min(triton.next_power_of_2(dv), 32 if v.is_cuda else 128)
    grid = (B, Hv, triton.cdiv(dv, BV))
    _recurrent_kernel[grid](
        q, k, v, gate_a, gate_b, A_log, dt_bias, o, state_pool,
        read_slots.contiguous(), write_slots.contiguous(),
        T, dk ** -0.5 if scale is None else scale,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        HV=Hv, GROUPS=Hv // Hk, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=BV,
        USE_L2NORM=use_qk_l2norm, FUSED_GATING=fused, num_warps=4 if dk * BV >= 4096 else 2)
    return o


@triton.jit
def _recurrent_kernel(q, k, v, gate_a, gate_b, A_log, dt_bias, o, pool, read_slots, write_slots,
                      T, scale,
                      sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                      HV: tl.constexpr, GROUPS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, USE_L2NORM: tl.constexpr,
                      FUSED_GATING: tl.constexpr):
    i_b = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_hk = i_hv // GROUPS
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    mask_s = mask_k[:, None] & mask_v[None, :]
    state_offs = i_hv * DK * DV + offs_k[:, None] * DV + offs_v[None, :]

    read = tl.load(read_slots + i_b).to(tl.int64)
    S = tl.load(pool + read * (HV * DK * DV) + state_offs, mask=mask_s, other=0.0).to(tl.float32)
    if FUSED_GATING:
        neg_A = -tl.exp(tl.load(A_log + i_hv).to(tl.float32))
        bias = tl.load(dt_bias + i_hv).to(tl.float32)

    for t in range(T):
        q_t = tl.load(q + i_b * sq_b + t * sq_t + i_hk * sq_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        k_t = tl.load(k + i_b * sk_b + t * sk_t + i_hk * sk_h + offs_k, mask=mask_k, other=0.0).to(tl.float32)
        v_t = tl.load(v + i_b * sv_b + t * sv_t + i_hv * sv_h + offs_v, mask=mask_v, other=0.0).to(tl.float32)
        if USE_L2NORM:
            q_t = q_t * tl.rsqrt(tl.sum(q_t * q_t) + 1e-6)
            k_t = k_t * tl.rsqrt(tl.sum(k_t * k_t) + 1e-6)
        q_t = q_t * scale
        gate_off = (i_b * T + t) * HV + i_hv
        x_a = tl.load(gate_a + gate_off).to(tl.float32)
        x_b = tl.load(gate_b + gate_off).to(tl.float32)
        if FUSED_GATING:
            x = x_a + bias
            softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))   # torch's threshold
            decay = tl.exp(neg_A * softplus)
            beta_t = tl.sigmoid(x_b)
        else:
            decay = tl.exp(x_a)
            beta_t = x_b
        S = S * decay
        u = beta_t * (v_t - tl.sum(S * k_t[:, None], axis=0))
        S = S + k_t[:, None] * u[None, :]
        o_t = tl.sum(S * q_t[:, None], axis=0)
        tl.store(o + ((i_b * T + t) * HV + i_hv) * DV + offs_v, o_t.to(o.dtype.element_ty), mask=mask_v)
        write = tl.load(write_slots + i_b * T + t).to(tl.int64)
        tl.store(pool + write * (HV * DK * DV) + state_offs, S.to(pool.dtype.element_ty),
                 mask=mask_s & (write >= 0))
