"""Triton causal conv (fla varlen prefill, our windowed update) and paged attention against
the torch ops."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import paged_kv_case
from triton_cases import TORCH, make_cu

from hybrid_engine.kernels import triton_backend

tk = triton_backend()     # the triton form of every op (the torch form where it has none)

# ---------------------------------------------------------------- causal conv1d


def test_conv_varlen_matches_torch(device):
    D, K = 6, 4
    lengths = [5, 1, 2, 0, 9]                          # 1 and 2 are shorter than the window
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(sum(lengths), D, generator=gen).to(device)
    weight = torch.randn(D, K, generator=gen).to(device)
    window = torch.randn(len(lengths), D, K - 1, generator=gen).to(device)
    cu_seqlens = make_cu(lengths, device)

    y, final = tk.causal_conv1d_varlen(x, weight, cu_seqlens, window)
    y_ref, final_ref = TORCH["causal_conv1d_varlen"](x, weight, cu_seqlens, window)

    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(final, final_ref)


@pytest.mark.parametrize("read, write", [
    ([2, 5, 0], [[2], [5], [0]]),                             # plain decode, in place
    ([2, 5, 0], [[1, 3, 4], [6, 7, 8], [9, -1, 0]]),          # verify windows; padding; own read slot
])
def test_conv_update_matches_torch(device, read, write):
    D, K = 40, 4                                              # not a power of two: masked channels
    read = torch.tensor(read, device=device)
    write = torch.tensor(write, device=device)
    B, T = write.shape
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, D, generator=gen).to(device)
    weight = torch.randn(D, K, generator=gen).to(device)
    pool = torch.randn(10, D, K - 1, generator=gen).to(device)
    pool_ref = pool.clone()

    y = tk.causal_conv1d_update(x, weight, pool, read, write)
    y_ref = TORCH["causal_conv1d_update"](x, weight, pool_ref, read, write)

    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, pool_ref)


def test_conv_update_longer_than_window_and_repeated_slot(device):
    # T > K-1: the last windows hold only new inputs; a slot repeated along t keeps the last
    D, K = 6, 3
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(1, 4, D, generator=gen).to(device)
    weight = torch.randn(D, K, generator=gen).to(device)
    pool = torch.randn(2, D, K - 1, generator=gen).to(device)
    pool_ref = pool.clone()
    read, write = torch.tensor([1], device=device), torch.tensor([[1, 1, 1, 1]], device=device)
    y = tk.causal_conv1d_update(x, weight, pool, read, write)
    y_ref = TORCH["causal_conv1d_update"](x, weight, pool_ref, read, write)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(pool, pool_ref)
    assert torch.equal(pool[1], x[0, -2:].t())


# ---------------------------------------------------------------- paged attention

NH, NKV, HD = 4, 2, 32


def _paged_setup(block_size, cached, new, seed, device):
    """NaN-filled cache holding the sequences' keys in shuffled blocks; -1 table tails."""
    case = paged_kv_case(block_size, cached, new, seed, NH, NKV, HD, TORCH["write_kv_cache"])
    return tuple(x.to(device) for x in case[:5])


@pytest.mark.parametrize("block_size, cached, new", [
    (16, [20, 0, 33, 10, 47], [5, 7, 1, 1, 3]),      # mixed: prefill chunks, fresh prefill, decodes, verify
    (1, [3, 0, 9], [2, 4, 1]),                        # page size 1
    (16, [0, 20, 47, 5], [1, 1, 1, 1]),               # pure decode (one row tile per sequence)
    (32, [0, 20, 47], [3, 3, 3]),                      # uniform verify
    (16, [5], [40]),                                   # one prefill spanning several query tiles
])
def test_paged_attention_matches_torch(device, block_size, cached, new):
    q, kv_cache, bt, cu_q, seq_lens = _paged_setup(block_size, cached, new, seed=20, device=device)
    o = tk.paged_attention(q, kv_cache, bt, cu_q, seq_lens, scale=HD ** -0.5)
    o_ref = TORCH["paged_attention"](q, kv_cache, bt, cu_q, seq_lens, scale=HD ** -0.5)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=2e-5)


def test_paged_attention_on_a_strided_query_view(device):
    # the model passes q as a view of the q|gate projection (head stride 2*hd)
    q, kv_cache, bt, cu_q, seq_lens = _paged_setup(16, [4, 9], [2, 1], seed=21, device=device)
    wide = torch.stack([q, torch.randn_like(q)], dim=-2).reshape(q.shape[0], NH, 2 * HD)
    view = wide[..., :HD]
    o = tk.paged_attention(view, kv_cache, bt, cu_q, seq_lens, scale=0.3)
    torch.testing.assert_close(o, TORCH["paged_attention"](q, kv_cache, bt, cu_q, seq_lens, scale=0.3),
                               atol=2e-5, rtol=2e-5)


def test_write_kv_cache_matches_torch(device):
    kv_cache = torch.zeros(4, 2, 2, NKV, HD, device=device)
    kv_ref = kv_cache.clone()
    k, v = torch.randn(3, NKV, HD, device=device), torch.randn(3, NKV, HD, device=device)
    slots = torch.tensor([5, -1, 0], device=device)
    tk.write_kv_cache(k, v, kv_cache, slots)
    TORCH["write_kv_cache"](k, v, kv_ref, slots)
    assert torch.equal(kv_cache, kv_ref)
