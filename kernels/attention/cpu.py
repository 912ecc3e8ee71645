"""Decode and verify attention read straight from the paged KV cache, with the native kernel
paged_attention.cpp: each cached key and value row is read once from its block (the torch form
in kernels/attention/reference.py gathers all of them into a new tensor in every layer first). Serves
steps whose sequences all have the same small number Q of new tokens (1, or k + 1 when
verifying k drafts); kernels/attention/reference.py `naive_paged_attention` is its reference.

Under torch.compile and eagerly alike the call is the operator
`hybrid_engine_cpu::paged_attention_decode` (kernels/native/ops.py, C++ from the checks to the kernel): one
extern call of a graph."""

from __future__ import annotations

import torch

from ..native.ops import native_ops
from . import reference

DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512
MAX_ROWS = 128          # queries per sequence x query heads per kv head (the kernel's bound)
# Steps with at most this many new tokens per sequence (decode, verify) read the cache in place
# where the native kernel runs; longer ones (prefills) keep the gather and sdpa, whose matrix
# products serve many queries better than the kernel's row-at-a-time loop.
NATIVE_MAX_QUERY_LEN = 16


def can_run_native(kv_cache: torch.Tensor, num_heads: int, query_len: int) -> bool:
    """Whether the kernel serves a step of `query_len` new tokens per sequence on this cache."""
    nkv, hd = kv_cache.shape[3], kv_cache.shape[4]
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES and kv_cache.is_contiguous()
            and hd % 16 == 0 and hd <= MAX_HEAD_DIM and num_heads % nkv == 0
            and 0 < query_len * (num_heads // nkv) <= MAX_ROWS and native_available())


# (a constant to traced graphs: compiled_steps.py marks it so, where torch.compile is imported)
def native_available() -> bool:
    return native_ops() is not None


def paged_attention_native(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, level: str | None = None) -> torch.Tensor:
    """q [N * Q, nh, hd] (Q new tokens per sequence, packed) -> o [N * Q, nh, hd] float32.
    kv_cache [num_blocks, 2, block_size, nkv, hd] float32 or bf16, holding this step's keys;
    block_tables [N, width] (entries past a sequence's blocks may hold anything); seq_lens [N]
    cached + new. level: the kernel built for that level of kernels/native/isa.py (None: this
    process's; tests run each level below it)."""
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"paged_attention_native: no kernel at level {level}")
    return ops.paged_attention_decode.default(q, kv_cache, block_tables, seq_lens, scale)


def paged_attention_op(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """paged_attention_native at this process's level, where `can_run_native` holds (the form
    callers and compiled graphs use: no lookup of the level's ops)."""
    return torch.ops.hybrid_engine_cpu.paged_attention_decode.default(q, kv_cache, block_tables, seq_lens, scale)


def reads_cache_in_place(kv_cache: torch.Tensor, num_heads: int, query_len: int) -> bool:
    """Whether decode attention of `query_len` new tokens per sequence runs the native kernel,
    which reads K and V in place through the block tables (so the step needs no PagedKeys)."""
    return 0 < query_len <= NATIVE_MAX_QUERY_LEN and can_run_native(kv_cache, num_heads, query_len)


def paged_attention(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, layout=None):
    query_len = layout.query_len if layout is not None else 0    # 0: lengths differ, or not known
    if q.shape[0] and reads_cache_in_place(kv_cache, q.shape[1], query_len):
        return paged_attention_op(q, kv_cache, block_tables, seq_lens, scale).to(q.dtype)
    return reference.paged_attention(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, layout)
