"""Kernel test inputs shared by the torch-op tests and the triton-vs-torch tests."""

from __future__ import annotations

import torch


def make_cu(lengths, device="cpu") -> torch.Tensor:
    """[0, l0, l0+l1, ...] int64: cu_seqlens of packed sequences of these lengths."""
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device=device)


def gdn_inputs(T, Hk=2, Hv=4, dk=16, dv=8, seed=0, device="cpu"):
    """q, k [T, Hk, dk], v [T, Hv, dv], g, beta [T, Hv] float32 for the gated delta rule."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hk, dk, generator=gen)
    k = torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    # strong decays: most steps lose up to e^-4, some tokens almost wipe the state (e^-20)
    g = -4 * torch.rand(T, Hv, generator=gen)
    g[torch.rand(T, Hv, generator=gen) < 0.1] = -20.0
    beta = torch.rand(T, Hv, generator=gen)
    return tuple(x.to(device) for x in (q, k, v, g, beta))


def paged_kv_case(block_size, cached, new, seed, nh, nkv, hd, write_kv_cache):
    """A NaN-filled paged cache holding each sequence's cached + new keys in shuffled blocks
    (block-table tails -1), written with `write_kv_cache`, and queries for the new tokens.
    -> q [sum(new), nh, hd], kv_cache, block_tables, cu_seqlens_q, seq_lens, keys, values
    (the dense per-sequence keys and values), all on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    totals = [c + n for c, n in zip(cached, new)]
    need = [-(-L // block_size) for L in totals]
    num_blocks = sum(need) + 3
    kv_cache = torch.full((num_blocks, 2, block_size, nkv, hd), float("nan"))
    block_ids = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((len(totals), max(need) + 1), -1, dtype=torch.int64)
    keys, values, start = [], [], 0
    for n, L in enumerate(totals):
        block_tables[n, :need[n]] = block_ids[start:start + need[n]]
        start += need[n]
        keys.append(torch.randn(L, nkv, hd, generator=gen))
        values.append(torch.randn(L, nkv, hd, generator=gen))
        pos = torch.arange(L)
        write_kv_cache(keys[n], values[n], kv_cache, block_tables[n, pos // block_size] * block_size + pos % block_size)
    q = torch.randn(sum(new), nh, hd, generator=gen)
    return q, kv_cache, block_tables, make_cu(new), torch.tensor(totals), keys, values
