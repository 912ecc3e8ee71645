"""Paged KV cache writes and causal attention over it (GQA).

Per layer the cache is [num_blocks, 2, block_size, nkv, hd] (index 0 = K, 1 = V); a flat slot
is block_id * block_size + offset.

What attention needs to know about a step's sequences (how they group by query length, where
each key sits in the cache, which keys each query sees) is the same for every attention layer
of the step: the caller computes it once (`attention_layout`, from the lengths it holds on the
host) and passes it to every layer, so no layer reads a length back from the device.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F



@dataclass(frozen=True)
class PagedKeys:
    """The keys of N sequences with Q new tokens each, as positions in the paged cache.

    blocks, offsets: [N, L] int64, L = the block table's width * block_size: key position l of
    sequence n sits at kv_cache[blocks[n, l], :, offsets[n, l]]. Positions past a sequence's
    length re-read its first key, so every gathered entry belongs to the sequence (block-table
    tails may hold garbage ids, unwritten slots NaN, and NaN * 0 would still poison the
    output); `visible` hides them. The first key, not the last, so that one more token changes
    one column (the step-input builder's steady decode state updates these in place).
    visible: [N, 1, Q, L] bool, key l seen by query q.
    """

    blocks: torch.Tensor
    offsets: torch.Tensor
    visible: torch.Tensor


@dataclass(frozen=True)
class QueryGroup:
    """Sequences of one query length within a step whose lengths differ."""

    query_len: int
    rows: torch.Tensor       # [n] int64, the sequences
    tokens: torch.Tensor     # [n, query_len] int64, their tokens' rows in the packed stream
    keys: PagedKeys


@dataclass(frozen=True)
class AttentionLayout:
    """A step's attention facts, shared by every attention layer.

    keys: when every sequence has the same number of new tokens (decode, verify, one prefill),
    one PagedKeys for all of them; otherwise None and `groups` holds one QueryGroup per length.
    Also None, with no groups, for a shared length whose attention reads no keys
    (`KernelBackend.attention_reads_keys`): the builder that knew it left them out.
    slots_valid: no KV slot of the step is negative (no padding rows to skip when writing).
    query_len: that shared number of new tokens (a host int; 0 where they differ or it is not
    known). With it, decode and verify steps on CPU read K and V straight from the blocks
    (kernels/attention/cpu.py: only the step's block_tables and seq_lens, not `keys`).
    """

    keys: PagedKeys | None
    groups: tuple[QueryGroup, ...]
    slots_valid: bool
    query_len: int = 0


def paged_keys(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_len: int,
               block_size: int) -> PagedKeys:
    """PagedKeys of sequences with `query_len` new tokens each (seq_lens: [N] cached + new)."""
    device = block_tables.device
    key_pos = torch.arange(block_tables.shape[1] * block_size, device=device)
    pos = key_pos * (key_pos < seq_lens[:, None])                                # [N, L]
    q_pos = (seq_lens - query_len)[:, None] + torch.arange(query_len, device=device)   # [N, Q]
    return PagedKeys(block_tables.gather(1, pos // block_size), pos % block_size,
                     (key_pos <= q_pos[:, :, None])[:, None])


def reads_no_keys(query_lens: Sequence[int], keyless: Container[int]) -> bool:
    """Whether the layout of a step whose sequences have these new-token counts has no keys:
    one shared count (none: 1), and one of `keyless`."""
    return len(set(query_lens)) <= 1 and (query_lens[0] if query_lens else 1) in keyless


def attention_layout(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_lens: Sequence[int],
                     block_size: int, slots_valid: bool, keyless: Container[int] = ()) -> AttentionLayout:
    """The layout of a step whose sequence n has query_lens[n] new tokens (host ints).
    keyless: shared query lengths whose attention needs no keys (`KernelBackend.attention_reads_keys`)."""
    if len(set(query_lens)) <= 1:
        q = query_lens[0] if query_lens else 1
        keys = None if reads_no_keys(query_lens, keyless) else paged_keys(block_tables, seq_lens, q, block_size)
        return AttentionLayout(keys, (), slots_valid, q)
    starts, groups = [0], {}
    for n, q in enumerate(query_lens):
        starts.append(starts[-1] + q)
        groups.setdefault(q, []).append(n)
    device = block_tables.device
    made = []
    for q, rows in groups.items():
        if q == 0:
            continue
        rows_t = torch.tensor(rows, dtype=torch.int64, device=device)
        tokens = torch.tensor([[starts[n] + i for i in range(q)] for n in rows], dtype=torch.int64, device=device)
        made.append(QueryGroup(q, rows_t, tokens, paged_keys(block_tables[rows_t], seq_lens[rows_t], q, block_size)))
    return AttentionLayout(None, tuple(made), slots_valid)


def layout_of(cu_seqlens_q: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
              block_size: int) -> AttentionLayout:
    """The layout read back from the tensors themselves, for callers that hold no host-side
    lengths (tests, benchmarks; the engine's steps never need it)."""
    return attention_layout(block_tables, seq_lens, cu_seqlens_q.diff().tolist(), block_size, True)


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, slots_valid: bool | None = None) -> None:
    """Store new keys and values in place.

    k, v: [T, nkv, hd]; kv_cache: [num_blocks, 2, block_size, nkv, hd]; slot_mapping: [T] int64
    flat slots (entries < 0 are padding and skipped). slots_valid: the caller knows that no
    slot is negative (AttentionLayout.slots_valid); None: checked here, a read-back.
    """
    if slots_valid is None:
        slots_valid = bool((slot_mapping >= 0).all())
    if not slots_valid:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = kv_cache.shape[2]
    # block and offset are advanced indices around a slice: the indexed view is [T, 2, nkv, hd]
    kv = torch.stack([k, v], 1).to(kv_cache.dtype)
    kv_cache[slot_mapping // block_size, :, slot_mapping % block_size] = kv


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                    layout: AttentionLayout | None = None) -> torch.Tensor:
    """Causal attention of N sequences' new tokens over their paged caches.

    q: [T, nh, hd] packed new tokens (cu_seqlens_q: [N+1] int64); kv_cache: [num_blocks, 2,
    block_size, nkv, hd], already holding this step's keys; block_tables: [N, max_blocks]
    (unused entries may hold anything); seq_lens: [N] int64 cached + new tokens.
    Query i of sequence n sits at position seq_lens[n] - qlen_n + i and sees keys at positions
    <= its own. q head h uses kv head h // (nh / nkv). layout: the step's AttentionLayout
    (None: read back from the tensors). Returns o: [T, nh, hd] in q.dtype.

    Sequences with the same query length are attended in one batched call (one gather of
    their keys in the cache's dtype, one sdpa with the visibility mask); a pure decode or
    verify step is therefore a single call with no Python loop. (The cpu backend reads the
    keys of decode and verify steps in place instead: kernels/attention/cpu.py.)
    """
    N, (T, nh, hd) = cu_seqlens_q.numel() - 1, q.shape
    if N == 0 or T == 0:
        return q.new_empty(q.shape)
    if layout is None:
        layout = layout_of(cu_seqlens_q, block_tables, seq_lens, kv_cache.shape[2])
    keys = layout.keys
    if keys is None and not layout.groups:
        raise ValueError("paged_attention: the step's AttentionLayout has no keys (its builder left them out for "
                         "a backend that reads the cache in place)")
    if keys is not None:
        # The query length as the mask has it (not T // N): under torch.compile the mask's size
        # is a symbol of its own, which sdpa must see the queries share.
        Q = keys.visible.shape[2]
        return attend_paged(q.view(N, Q, nh, hd), kv_cache, keys, scale).view(T, nh, hd)
    out = q.new_empty(q.shape)
    for group in layout.groups:
        out[group.tokens] = attend_paged(q[group.tokens], kv_cache, group.keys, scale)
    return out


def attend_paged(q: torch.Tensor, kv_cache: torch.Tensor, keys: PagedKeys, scale: float) -> torch.Tensor:
    """q: [N, Q, nh, hd] -> o: [N, Q, nh, hd] over the keys at `keys`.

    K and V are gathered once, in the cache's own dtype (no float32 copy of a bf16 cache);
    sdpa accumulates in float32 for reduced dtypes. q is brought to the cache's dtype.
    """
    nh, nkv = q.shape[2], kv_cache.shape[3]
    k, v = kv_cache[keys.blocks, :, keys.offsets].transpose(1, 3).unbind(2)   # [N, nkv, L, hd]
    o = F.scaled_dot_product_attention(q.transpose(1, 2).to(k.dtype), k, v, attn_mask=keys.visible,
                                       scale=scale, enable_gqa=nh != nkv)
    return o.transpose(1, 2).to(q.dtype)


def naive_paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                          cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference: per sequence, its keys copied out of the blocks in float32 and a plain
    masked softmax. Same contract as paged_attention."""
    bs, nkv = kv_cache.shape[2], kv_cache.shape[3]
    nh = q.shape[1]
    out = []
    for n, (start, end) in enumerate(zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist())):
        L, Q = int(seq_lens[n]), end - start
        pos = torch.arange(L)
        kv = kv_cache[block_tables[n, pos // bs], :, pos % bs].float()                # [L, 2, nkv, hd]
        k, v = (t.repeat_interleave(nh // nkv, 1).transpose(0, 1) for t in kv.unbind(1))   # [nh, L, hd]
        scores = q[start:end].float().transpose(0, 1) @ k.transpose(1, 2) * scale   # [nh, Q, L]
        visible = pos <= (L - Q + torch.arange(Q))[:, None]
        out.append((scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(out).to(q.dtype) if out else q.new_empty(q.shape)
