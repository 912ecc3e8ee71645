"""Paged KV writes and causal GQA attention over block tables, on the triton backend.

One program handles one sequence, one KV head and a tile of BLOCK_Q new tokens; its rows
are (token, query head of the group) pairs, so a decode step with G query heads per KV head
still fills a dot tile. Keys are walked in BLOCK_N positions at a time, each position's
block looked up in the block table, so any page size works (1 included). Online softmax
in fp32. The grid is sized without reading lengths back from the device (no sync, so a
decode step can be captured in a CUDA graph); tiles past a sequence's length exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_support.common import checks_enabled, contiguous_last


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, slots_valid: bool | None = None) -> None:
    """Same contract as the torch op (kernels/attention/reference.py); negative slots are skipped in the
    kernel, so slots_valid is not needed."""
    T, nkv, hd = k.shape
    if T == 0:
        return
    k, v = contiguous_last(k), contiguous_last(v)
    _write_kv_kernel[(T, nkv)](
        k, v, kv_cache, slot_mapping.contiguous(), kv_cache.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HD=hd, BHD=triton.next_power_of_2(hd))


@triton.jit
def _write_kv_kernel(k, v, cache, slot_mapping, block_size, sk_t, sk_h, sv_t, sv_h,
                     sc_blk, sc_kv, sc_pos, sc_h, HD: tl.constexpr, BHD: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    offs = tl.arange(0, BHD)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    mask = (offs < HD) & (slot >= 0)
    dst = cache + (slot // block_size) * sc_blk + (slot % block_size) * sc_pos + h * sc_h + offs
    k_row = tl.load(k + t * sk_t + h * sk_h + offs, mask=mask)
    v_row = tl.load(v + t * sv_t + h * sv_h + offs, mask=mask)
    tl.store(dst, k_row.to(cache.dtype.element_ty), mask=mask)
    tl.store(dst + sc_kv, v_row.to(cache.dtype.element_ty), mask=mask)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    layout=None) -> torch.Tensor:
    """Same contract as the torch op, for sequences of at least one new token each (the
    engine never schedules an empty one; checked on CPU tensors). The kernel walks the block
    tables itself, so the torch op's AttentionLayout is not needed."""
    T, nh, hd = q.shape
    N = cu_seqlens_q.numel() - 1
    nkv = kv_cache.shape[3]
    o = torch.empty(T, nh, hd, dtype=q.dtype, device=q.device)
    if N == 0 or T == 0:
        return o
    if checks_enabled(q) and bool((cu_seqlens_q[1:] <= cu_seqlens_q[:-1]).any()):
        raise ValueError("triton paged_attention: every sequence needs at least one new token")
    q = contiguous_last(q)
    G = nh // nkv
    max_qlen = T - N + 1                       # a bound from host-side shapes only: no sync
    block_q = 1 if max_qlen == 1 else min(triton.next_power_of_2(max_qlen), max(1, 64 // G))
    block_m = max(16, triton.next_power_of_2(block_q * G))
    block_n = 32 if hd > 128 else 64
    grid = (N, nkv, triton.cdiv(max_qlen, block_q))
    _paged_attention_kernel[grid](
        q, kv_cache, block_tables, cu_seqlens_q.contiguous(), seq_lens.contiguous(), o, scale,
        kv_cache.shape[2], q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        G=G, HD=hd, BHD=max(16, triton.next_power_of_2(hd)), BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=block_n, IEEE_DOT=q.dtype == torch.float32, num_warps=4 if block_m <= 32 else 8)
    return o


@triton.jit
def _paged_attention_kernel(q, cache, block_tables, cu_seqlens_q, seq_lens, o, scale, block_size,
                            sq_t, sq_h, so_t, so_h, sc_blk, sc_kv, sc_pos, sc_h, sbt_n,
                            G: tl.constexpr, HD: tl.constexpr, BHD: tl.constexpr,
                            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            IEEE_DOT: tl.constexpr):
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    tile = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q + n)
    qlen = tl.load(cu_seqlens_q + n + 1) - q_start
    if tile * BLOCK_Q >= qlen:
        return
    seq_len = tl.load(seq_lens + n)

    rows = tl.arange(0, BLOCK_M)
    tok = tile * BLOCK_Q + rows // G
    head = kvh * G + rows % G
    row_ok = (rows < BLOCK_Q * G) & (tok < qlen)
    q_pos = seq_len - qlen + tok                              # absolute position of each row
    offs_d = tl.arange(0, BHD)
    mask_d = offs_d < HD
    q_tile = tl.load(q + (q_start + tok)[:, None] * sq_t + head[:, None] * sq_h + offs_d[None, :],
                     mask=row_ok[:, None] & mask_d[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BHD], tl.float32)
    kv_end = seq_len - qlen + tl.minimum((tile + 1) * BLOCK_Q, qlen)   # last row's position + 1
    bt_row = block_tables + n * sbt_n
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        # Only positions below the length are looked up: table tails may hold garbage ids.
        block = tl.load(bt_row + k_pos // block_size, mask=k_ok, other=0).to(tl.int64)
        base = block * sc_blk + (k_pos % block_size) * sc_pos + kvh * sc_h
        kv_mask = k_ok[:, None] & mask_d[None, :]
        k_tile = tl.load(cache + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v_tile = tl.load(cache + sc_kv + base[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE_DOT:
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision="ieee")
        else:
            s = tl.dot(q_tile, tl.trans(k_tile))
        s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE_DOT:
            pv = tl.dot(p, v_tile, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v_tile.dtype), v_tile)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o + (q_start + tok)[:, None] * so_t + head[:, None] * so_h + offs_d[None, :],
             out.to(o.dtype.element_ty), mask=row_ok[:, None] & mask_d[None, :])
