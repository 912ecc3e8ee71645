"""Triton GDN ops (fla chunked prefill, our slot-pool decode/verify) against the torch ops."""

from __future__ import annotations

import pytest
import torch
from triton_cases import TORCH, gdn_inputs, make_cu

from hybrid_engine.kernels import triton_backend

tk = triton_backend()     # the triton form of every op (the torch form where it has none)

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("Hk, lengths", [(2, [1, 7, 0, 70]), (4, [33])])
def test_chunk_matches_torch(device, Hk, lengths):
    Hv, dk, dv = 4, 16, 8
    q, k, v, g, beta = gdn_inputs(sum(lengths), Hk, Hv, dk, dv, seed=1, device=device)
    cu_seqlens = make_cu(lengths, device)
    init = 0.5 * torch.randn(len(lengths), Hv, dk, dv, generator=torch.Generator().manual_seed(2)).to(device)
    init_copy = init.clone()

    o, final = tk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, init)
    o_ref, final_ref = TORCH["chunk_gated_delta_rule"](q, k, v, g, beta, cu_seqlens, init)

    assert o.dtype == v.dtype and final.dtype == torch.float32
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(final, final_ref, **TOL)
    assert torch.equal(init, init_copy)


def test_chunk_captures_states_at_cuts_like_torch(device):
    """Prefix checkpoints inside a prefill: the state at each cut (offsets not multiples of 64,
    one at a sequence's end) lands in its capture slot, and the outputs are the uncut ones."""
    from hybrid_engine.kernels.gdn.chunk import ChunkLayout

    lengths, cuts = [150, 37, 90], [[40, 112, 150], [], [16]]
    Hv, dk, dv = 4, 16, 8
    q, k, v, g, beta = gdn_inputs(sum(lengths), 2, Hv, dk, dv, seed=4, device=device)
    cu_seqlens = make_cu(lengths, device)
    init = 0.5 * torch.randn(len(lengths), Hv, dk, dv, generator=torch.Generator().manual_seed(5)).to(device)
    slots = torch.tensor([6, 2, 4, 0], device=device)
    layout = ChunkLayout(lengths, device=device, cuts=cuts)
    pool, pool_ref = (torch.zeros(8, Hv, dk, dv, device=device) for _ in range(2))

    o, final = tk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, init, layout=layout,
                                         capture_pool=pool, capture_slots=slots)
    o_ref, final_ref = TORCH["chunk_gated_delta_rule"](q, k, v, g, beta, cu_seqlens, init, layout=layout,
                                                       capture_pool=pool_ref, capture_slots=slots)
    o_uncut, _ = tk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, init)

    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(final, final_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)
    torch.testing.assert_close(o, o_uncut, **TOL)
    torch.testing.assert_close(pool[slots[2]], final[0], **TOL)          # the cut at 150 = the end


def test_chunk_scale_without_l2norm(device):
    q, k, v, g, beta = gdn_inputs(40, seed=3, device=device)
    q, k = 0.3 * q, 0.3 * k
    init = torch.zeros(1, 4, 16, 8, device=device)
    args = (q, k, v, g, beta, make_cu([40], device), init)
    o, final = tk.chunk_gated_delta_rule(*args, scale=0.7, use_qk_l2norm=False)
    o_ref, final_ref = TORCH["chunk_gated_delta_rule"](*args, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(final, final_ref, **TOL)


def _recurrent_case(B, T, seed, device, Hk=2):
    Hv, dk, dv = 4, 16, 8
    q, k, v, g, beta = gdn_inputs(B * T, Hk, Hv, dk, dv, seed=seed, device=device)
    q, k = q.view(B, T, Hk, dk), k.view(B, T, Hk, dk)
    v, g, beta = v.view(B, T, Hv, dv), g.view(B, T, Hv), beta.view(B, T, Hv)
    pool = torch.randn(16, Hv, dk, dv, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    return q, k, v, g, beta, pool


@pytest.mark.parametrize("read, write", [
    ([4, 0, 7], [[4], [0], [7]]),                          # plain decode, in place
    ([4, 0, 7], [[1, 2, 3], [5, 6, 8], [9, 10, 7]]),       # verify: one slot per position
    ([4, 0], [[11, -1, 4], [-1, 12, -1]]),                 # padding entries skipped; last = read slot
])
def test_recurrent_matches_torch(device, read, write):
    read = torch.tensor(read, device=device)
    write = torch.tensor(write, device=device)
    B, T = write.shape
    q, k, v, g, beta, pool = _recurrent_case(B, T, seed=5, device=device)
    pool_ref = pool.clone()

    o = tk.recurrent_gated_delta_rule(q, k, v, g, beta, pool, read, write)
    o_ref = TORCH["recurrent_gated_delta_rule"](q, k, v, g, beta, pool_ref, read, write)

    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(pool, pool_ref, **TOL)      # written slots and untouched ones


def test_gdn_decode_matches_torch(device):
    """The layer's decode step from its projections: mixed, b, a column slices of one output."""
    B, T, Hk, Hv, dk, dv, K = 2, 3, 2, 4, 16, 8, 4
    D = 2 * Hk * dk + Hv * dv
    gen = torch.Generator().manual_seed(13)
    proj = torch.randn(B, T, D + 2 * Hv, generator=gen).to(device)
    mixed, b, a = proj[..., :D], proj[..., D:D + Hv], proj[..., D + Hv:]
    conv_weight = torch.randn(D, K, generator=gen).to(device)
    dt_bias = torch.randn(Hv, generator=gen).to(device)
    neg_decay_rate = -torch.empty(Hv).uniform_(0.01, 16, generator=gen).to(device)
    conv_pool = torch.randn(16, D, K - 1, generator=gen).to(device)
    state_pool = torch.randn(16, Hv, dk, dv, generator=gen).to(device)
    read = torch.tensor([3, 9], device=device)
    write = torch.tensor([[3, 1, -1], [9, 2, 9]], device=device)
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()

    o = tk.gdn_decode(mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_pool, state_pool, read, write)
    o_ref = TORCH["gdn_decode"](mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_ref, state_ref, read, write)
    torch.testing.assert_close(o, o_ref, **TOL)
    torch.testing.assert_close(conv_pool, conv_ref, **TOL)
    torch.testing.assert_close(state_pool, state_ref, **TOL)


def test_recurrent_rejects_writing_another_rows_read_slot(device):
    if device == "cuda":
        pytest.skip("the host-side check is opt-in on a GPU (HYBRID_ENGINE_KERNEL_CHECKS=1)")
    q, k, v, g, beta, pool = _recurrent_case(2, 1, seed=9, device=device)
    with pytest.raises(ValueError, match="another row's read slot"):
        tk.recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([4, 0]), torch.tensor([[0], [4]]))
    with pytest.raises(ValueError, match="share a write slot"):
        tk.recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([4, 0]), torch.tensor([[5], [5]]))


def test_decode_steps_continue_a_chunked_prefill(device):
    # prefill 20 tokens with fla's chunk kernel, then decode 3 one at a time from the pool
    q, k, v, g, beta = gdn_inputs(23, seed=10, device=device)
    pool = torch.zeros(3, 4, 16, 8, device=device)
    _, state = tk.chunk_gated_delta_rule(q[:20], k[:20], v[:20], g[:20], beta[:20], make_cu([20], device), pool[1:2])
    pool[1] = state[0]
    slot = torch.tensor([1], device=device)
    outs = [tk.recurrent_gated_delta_rule(q[t][None, None], k[t][None, None], v[t][None, None],
                                          g[t][None, None], beta[t][None, None], pool, slot, slot[:, None])
            for t in range(20, 23)]
    o_ref, final_ref = TORCH["chunk_gated_delta_rule"](q, k, v, g, beta, make_cu([23], device), torch.zeros(1, 4, 16, 8, device=device))
    torch.testing.assert_close(torch.cat(outs, 1)[0], o_ref[20:], **TOL)
    torch.testing.assert_close(pool[1], final_ref[0], **TOL)
