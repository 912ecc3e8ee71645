"""Decode and verify attention read straight from the paged KV cache, with the native kernel
paged_attention.cpp: each cached key and value row is read once from its block (the torch form
in kernels/attention.py gathers all of them into a new tensor in every layer first). Serves
steps whose sequences all have the same small number Q of new tokens (1, or k + 1 when
verifying k drafts); kernels/attention.py `naive_paged_attention` is its reference.

Under torch.compile and eagerly alike the call is the graph op
`hybrid_engine_cpu::paged_attention_decode` (graph_op.py): one extern call of the graph."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library
from .graph_op import define_graph_op

SOURCE = Path(__file__).with_name("paged_attention.cpp")
DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512
MAX_ROWS = 128          # queries per sequence x query heads per kv head (the kernel's bound)
_ERRORS = {1: "unsupported shape", 2: "a sequence shorter than its queries or longer than its block table",
           3: "a block id outside the cache"}


def can_run_native(kv_cache: torch.Tensor, num_heads: int, query_len: int) -> bool:
    """Whether the kernel serves a step of `query_len` new tokens per sequence on this cache."""
    nkv, hd = kv_cache.shape[3], kv_cache.shape[4]
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES and kv_cache.is_contiguous()
            and hd % 16 == 0 and hd <= MAX_HEAD_DIM and num_heads % nkv == 0
            and 0 < query_len * (num_heads // nkv) <= MAX_ROWS and native_available())


@torch.compiler.assume_constant_result      # traced graphs take the answer as a constant
def native_available() -> bool:
    return _library(None) is not None


def paged_attention_native(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, level: str | None = None) -> torch.Tensor:
    """q [N * Q, nh, hd] (Q new tokens per sequence, packed) -> o [N * Q, nh, hd] float32.
    kv_cache [num_blocks, 2, block_size, nkv, hd] float32 or bf16, holding this step's keys;
    block_tables [N, width] (entries past a sequence's blocks may hold anything); seq_lens [N]
    cached + new. level: the kernel built for that level of kernels/cpu/isa.py (None: this
    process's; tests run each level below it)."""
    T, nh, hd = q.shape
    N = seq_lens.shape[0]
    num_blocks, _, bs, nkv, _ = kv_cache.shape
    lib = _library(level)
    if lib is None or kv_cache.dtype not in DTYPES or not kv_cache.is_contiguous():
        raise ValueError(f"paged_attention_native: no kernel for a {kv_cache.dtype} cache at level {level}")
    o = torch.empty(T, nh, hd)
    if N == 0 or T == 0:
        return o
    q = q.float().contiguous()
    block_tables = block_tables.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    fn = lib.paged_attention_f32 if kv_cache.dtype == torch.float32 else lib.paged_attention_bf16
    err = fn(q.data_ptr(), kv_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(), o.data_ptr(),
             num_blocks, N, T // N, nh, nkv, hd, bs, block_tables.shape[1], scale, torch.get_num_threads())
    if err:
        raise ValueError(f"paged_attention_native: {_ERRORS.get(err, err)} (q {tuple(q.shape)}, cache "
                         f"{tuple(kv_cache.shape)}, block table {tuple(block_tables.shape)})")
    return o


def _native_op(q, kv_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    return paged_attention_native(q, kv_cache, block_tables, seq_lens, scale)


paged_attention_op = define_graph_op(
    "paged_attention_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, float scale) "
    "-> Tensor", _native_op, lambda q, *_: q.new_empty(q.shape, dtype=torch.float32))


@functools.lru_cache(maxsize=None)
def _library(level: str | None) -> ctypes.CDLL | None:
    lib = load_library(SOURCE, level)
    if lib is not None:
        args = [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_int] * 7 + [ctypes.c_float, ctypes.c_int]
        for fn in (lib.paged_attention_f32, lib.paged_attention_bf16):
            fn.argtypes, fn.restype = args, ctypes.c_int
    return lib
