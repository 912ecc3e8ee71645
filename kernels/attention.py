"""Paged KV cache writes and causal attention over it (GQA).

Per layer the cache is [num_blocks, 2, block_size, nkv, hd] (index 0 = K, 1 = V); a flat slot
is block_id * block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .slot_pool import slots_valid


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Store new keys and values in place.

    k, v: [T, nkv, hd]; kv_cache: [num_blocks, 2, block_size, nkv, hd]; slot_mapping: [T] int64
    flat slots (entries < 0 are padding and skipped).
    """
    if not slots_valid(slot_mapping):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = kv_cache.shape[2]
    # block and offset are advanced indices around a slice: the indexed view is [T, 2, nkv, hd]
    kv = torch.stack([k, v], 1).to(kv_cache.dtype)
    kv_cache[slot_mapping // block_size, :, slot_mapping % block_size] = kv


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of N sequences' new tokens over their paged caches.

    q: [T, nh, hd] packed new tokens (cu_seqlens_q: [N+1] int64); kv_cache: [num_blocks, 2,
    block_size, nkv, hd], already holding this step's keys; block_tables: [N, max_blocks]
    (unused entries may hold anything); seq_lens: [N] int64 cached + new tokens.
    Query i of sequence n sits at position seq_lens[n] - qlen_n + i and sees keys at positions
    <= its own. q head h uses kv head h // (nh / nkv). Softmax in fp32.
    Returns o: [T, nh, hd] in q.dtype.

    Sequences with the same qlen are attended in one batched call (one gather, a length mask,
    one sdpa); a pure decode or verify step is therefore a single call with no Python loop.
    """
    N, (T, nh, hd) = cu_seqlens_q.numel() - 1, q.shape
    if N == 0 or T == 0:
        return q.new_empty(q.shape)
    Q = T // N
    if torch.compiler.is_compiling():
        # Traced steps (hybrid_engine/compiled_steps.py) have equal query lengths and may not
        # read anything back to the host: keys span the block table's width, masked by length.
        return _attend_equal_qlen(q.reshape(N, Q, nh, hd), kv_cache, block_tables, seq_lens, scale,
                                  key_len=block_tables.shape[1] * kv_cache.shape[2]).reshape(T, nh, hd)
    if Q * N == T and (N == 1 or int(cu_seqlens_q.diff().max()) == Q):   # N * Q tokens, no run above Q
        return _attend_equal_qlen(q.reshape(N, Q, nh, hd), kv_cache, block_tables, seq_lens, scale
                                  ).reshape(T, nh, hd)
    qlens = cu_seqlens_q.diff()
    out = q.new_empty(q.shape)
    for Q in torch.unique(qlens).tolist():
        if Q == 0:
            continue
        rows = torch.nonzero(qlens == Q).flatten()
        tokens = cu_seqlens_q[rows][:, None] + torch.arange(Q, device=q.device)   # [n, Q]
        out[tokens] = _attend_equal_qlen(q[tokens], kv_cache, block_tables[rows], seq_lens[rows], scale)
    return out


def _attend_equal_qlen(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float, key_len: int | None = None) -> torch.Tensor:
    """q: [N, Q, nh, hd], every sequence with Q new tokens -> o: [N, Q, nh, hd]. key_len: how
    many key positions to gather (at least max(seq_lens)); None: exactly max(seq_lens)."""
    N, Q, nh, hd = q.shape
    nkv, block_size = kv_cache.shape[3], kv_cache.shape[2]
    exact = key_len is None
    max_len = max(seq_lens.tolist()) if exact else key_len              # a read-back, no op dispatched
    key_pos = torch.arange(max_len, device=q.device)
    # Positions past a sequence's length re-read its last key: every gathered slot then belongs
    # to the sequence (block-table tails may hold garbage ids, unwritten slots may hold NaN,
    # and NaN * 0 would still poison the output), and the mask below hides them. A single
    # sequence has none.
    pos = key_pos[None] if N == 1 and exact else torch.minimum(key_pos, (seq_lens - 1)[:, None])   # [N, L]
    blocks = block_tables.gather(1, pos // block_size)
    k, v = kv_cache[blocks, :, pos % block_size].float().transpose(1, 3).unbind(2)  # [N, nkv, L, hd]
    # One sequence decoding one token sees all max_len keys: no mask to build.
    mask = None
    if N > 1 or Q > 1 or not exact:
        q_pos = (seq_lens - Q)[:, None] + torch.arange(Q, device=q.device)   # [N, Q]
        mask = (key_pos <= q_pos[:, :, None])[:, None]                      # [N, 1, Q, L]
    o = F.scaled_dot_product_attention(q.transpose(1, 2).float(), k, v, attn_mask=mask,
                                       scale=scale, enable_gqa=nh != nkv)
    return o.transpose(1, 2).to(q.dtype)
