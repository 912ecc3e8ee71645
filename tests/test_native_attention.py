"""kernels/attention/paged_attention.cpp: decode and verify attention read in place from the paged
cache == the per-sequence float32 reference (kernels/attention/reference.py `naive_paged_attention`),
at every native level this process may run (the kernel built for each), and paged_attention
takes it (eager and traced) where it runs and the torch form where it does not (level none:
HYBRID_ENGINE_CPU_ISA=none)."""

from __future__ import annotations

import pytest
import torch


from hybrid_engine.kernels.attention import attention_layout, naive_paged_attention
from hybrid_engine.kernels.attention import cpu as native
from hybrid_engine.kernels.native.isa import LEVELS, at_least, cpu_level
from hybrid_engine.kernels.native.compile_marks import mark_native_checks
from op_calls import recorded_calls

mark_native_checks()     # compiled ops' routing checks are constants to dynamo, as in compiled steps

NATIVE_LEVELS = [lvl for lvl in LEVELS[1:] if at_least(lvl)]   # the levels this process may run


def _case(seed, N, Q, nh, nkv, hd, block_size, dtype):
    """N sequences of random lengths (>= Q) in shuffled blocks of a NaN-filled cache; block-table
    tails hold garbage (-1, ids of other sequences' blocks, ids past the cache). Slots past a
    sequence's length inside its last block stay NaN. -> q [N*Q, nh, hd], cache, table, lens."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(Q, 90, (N,), generator=g)
    need = [-(-int(L) // block_size) for L in lens]
    width = max(need) + 2
    num_blocks = sum(need) + 4
    cache = torch.full((num_blocks, 2, block_size, nkv, hd), float("nan"))
    ids = torch.randperm(num_blocks, generator=g)
    garbage = torch.tensor([-1, int(ids[0]), num_blocks + 7, 2 ** 40])
    table = garbage[torch.randint(0, 4, (N, width), generator=g)]
    start = 0
    for n, L in enumerate(lens.tolist()):
        table[n, :need[n]] = ids[start:start + need[n]]
        start += need[n]
        pos = torch.arange(L)
        cache[table[n, pos // block_size], :, pos % block_size] = torch.randn(L, 2, nkv, hd, generator=g)
    q = torch.randn(N * Q, nh, hd, generator=g)
    return q.to(dtype), cache.to(dtype), table, lens


def _reference(q, cache, table, lens):
    """The float32 reference on the same (possibly bf16) inputs: only the kernel's arithmetic differs."""
    Q = q.shape[0] // lens.shape[0]
    cu = torch.arange(lens.shape[0] + 1) * Q
    return naive_paged_attention(q.float(), cache, table, cu, lens, 0.25)


CASES = [  # seed, N, Q, nh, nkv, hd, block_size
    (1, 1, 1, 8, 2, 256, 16),      # batch-1 decode at Qwen3.5-0.8B's head dims
    (2, 4, 1, 4, 4, 32, 16),       # no GQA
    (3, 3, 2, 8, 2, 64, 4),        # verify k = 1
    (4, 5, 3, 4, 1, 16, 1),        # verify k = 2, one kv head, one slot per block
    (5, 2, 4, 16, 4, 128, 32),     # k = 3
    (6, 3, 5, 8, 2, 48, 16),       # k = 4; head dim not a multiple of the AVX-512 width twice
    # heads a kv head serves (the kernel takes them 4, 2 and 1 at a time): 3, 5 and 6
    (7, 2, 2, 6, 2, 32, 16),
    (8, 1, 3, 10, 2, 64, 8),
    (9, 2, 1, 12, 2, 48, 16),
]


@pytest.mark.skipif(not NATIVE_LEVELS, reason="CPU level none (HYBRID_ENGINE_CPU_ISA=none or no AVX2+FMA): no native kernel may run; the torch form there is checked by test_paged_attention_takes_the_native_kernel_where_it_runs")
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed, N, Q, nh, nkv, hd, block_size", CASES)
def test_native_matches_the_reference(level, dtype, seed, N, Q, nh, nkv, hd, block_size):
    q, cache, table, lens = _case(seed, N, Q, nh, nkv, hd, block_size, dtype)
    got = native.paged_attention_native(q, cache, table, lens, 0.25, level=level)
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, _reference(q, cache, table, lens), atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(not NATIVE_LEVELS, reason="CPU level none (HYBRID_ENGINE_CPU_ISA=none or no AVX2+FMA): no native kernel may run; the torch form there is checked by test_paged_attention_takes_the_native_kernel_where_it_runs")
def test_native_rejects_a_block_outside_the_cache():
    q, cache, table, lens = _case(7, 2, 1, 4, 2, 32, 16, torch.float32)
    table[1, 0] = cache.shape[0]
    with pytest.raises(ValueError, match="a block id outside the cache"):
        native.paged_attention_native(q, cache, table, lens, 0.25)


def _paged(q, cache, table, lens, compiled=False):
    Q = q.shape[0] // lens.shape[0]
    cu = torch.arange(lens.shape[0] + 1) * Q
    layout = attention_layout(table, lens, [Q] * lens.shape[0], cache.shape[2], slots_valid=True)
    op = native.paged_attention
    if compiled:   # tracing only, in one graph: the path of compiled steps, nothing read back
        op = torch.compile(op, backend="eager", fullgraph=True, dynamic=False)
    return op(q, cache, table, cu, lens, 0.25, layout)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed, N, Q, nh, nkv, hd, block_size", [CASES[0], CASES[2], CASES[5]])
def test_paged_attention_takes_the_native_kernel_where_it_runs(seed, N, Q, nh, nkv, hd, block_size, dtype,
                                                               compiled):
    """At a native level the op calls the kernel (eager and traced); at level none it keeps the
    gather + sdpa form. Either way the result is the reference's, in q's dtype."""
    q, cache, table, lens = _case(seed, N, Q, nh, nkv, hd, block_size, dtype)
    with recorded_calls("paged_attention_decode") as calls:
        got = _paged(q, cache, table, lens, compiled)
    assert got.dtype == dtype and bool(calls) == (cpu_level() != "none")
    tol = 2e-5 if dtype == torch.float32 else 1e-2        # the output is rounded to bf16
    torch.testing.assert_close(got.float(), _reference(q, cache, table, lens), atol=tol, rtol=tol)


def test_long_queries_keep_the_torch_form():
    """A uniform step of many new tokens per sequence (one prefill) is not the kernel's."""
    q, cache, table, lens = _case(8, 1, 20, 8, 2, 32, 16, torch.float32)
    with recorded_calls("paged_attention_decode") as calls:
        got = _paged(q, cache, table, lens)
    assert not calls
    torch.testing.assert_close(got, _reference(q, cache, table, lens), atol=1e-5, rtol=1e-5)
