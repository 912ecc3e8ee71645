"""kernels/conv/causal_conv1d_update.cpp: the decode/verify conv update == the torch form
(kernels/conv/reference.py `causal_conv1d_update_torch`) at every native level this process
may run, causal_conv1d_update takes it (eager and traced) where it runs and the torch form
where it does not, and the engine's greedy tokens (plain decode and MTP verify) are the same
with it as with the torch form, and as transformers'."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybrid_engine import LLM

from hybrid_engine.kernels.conv.reference import causal_conv1d_update_torch
from hybrid_engine.kernels.conv.cpu import causal_conv1d_update      # the cpu backend's op
from hybrid_engine.kernels.conv import cpu as native
from hybrid_engine.kernels.gdn import decode_cpu as native_gdn_decode
from hybrid_engine.kernels.native.isa import LEVELS, at_least, cpu_level
from hybrid_engine.kernels.slot_pool import DecodeRows
from hybrid_engine.kernels.native.compile_marks import mark_native_checks

from checkpoints import make_hf_model, save_checkpoint
from engine_checks import assert_greedy_matches_transformers, greedy_tokens
from op_calls import recorded_calls
from spec_models import make_spec_checkpoint

mark_native_checks()     # compiled ops' routing checks are constants to dynamo, as in compiled steps

NATIVE_LEVELS = [lvl for lvl in LEVELS[1:] if at_least(lvl)]   # the levels this process may run
NO_NATIVE = "CPU level none (HYBRID_ENGINE_CPU_ISA=none or no AVX2+FMA): no native kernel may run; " \
            "test_the_update_takes_the_kernel_where_it_runs checks the torch form there"
DTYPES = [torch.float32, torch.bfloat16]


def _case(seed, B, T, D, K, dtype, weight_dtype=None, alias=False):
    """Random inputs and slots as a verify step lays them out (token 0 back to the read slot,
    later tokens to other slots), with padding (-1) and, in one row, a slot repeated along t.
    alias: row 1 also writes row 0's read slot (the torch form reads every window first)."""
    g = torch.Generator().manual_seed(seed)
    S = 2 * B * T + 3
    x = (torch.randn(B, T, D, generator=g) * 3).to(dtype)
    weight = torch.randn(D, K, generator=g).to(weight_dtype or dtype)
    pool = torch.randn(S, D, K - 1, generator=g).to(dtype)
    perm = torch.randperm(S, generator=g)
    read = perm[:B]
    write = torch.cat([read[:, None], perm[B:B + B * (T - 1)].view(B, T - 1)], 1)
    if T > 1:
        write[-1, T // 2:] = -1                          # a padded tail
        write[0, -1] = write[0, 0]                       # the last window wins
    if alias and B > 1:
        write[1, -1] = read[0]
    return x, weight, pool, read, write


def assert_same_outputs(got, want):
    """fp32: within 1e-6 (torch's SiLU on a tail shorter than its vector takes libm's exp, an ulp
    apart at most); bf16: bitwise or one bf16 ulp."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, f"{int((ulps > 1).sum())} outputs more than one bf16 ulp apart"


CASES = [  # seed, B, T, D, K
    (1, 1, 1, 6144, 4),     # batch-1 decode at Qwen3.5-0.8B's conv width
    (2, 4, 1, 200, 4),      # decode; D a multiple of 8, not of 16
    (3, 3, 4, 37, 4),       # verify k = 3; D a multiple of neither
    (4, 2, 8, 100, 4),
    (5, 5, 2, 16, 3),
    (6, 2, 3, 21, 2),
    (7, 1, 6, 5, 3),        # fewer channels than one vector
    (12, 3, 3, 1100, 4),    # several chunks of channels, the last one short
    (13, 4, 3, 6001, 4),    # enough outputs for the kernel to use more than one thread
]


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, B, T, D, K", CASES)
def test_native_matches_the_torch_form(level, dtype, seed, B, T, D, K):
    x, weight, pool, read, write = _case(seed, B, T, D, K, dtype, alias=True)
    want_pool = pool.clone()
    want = causal_conv1d_update_torch(x, weight, want_pool, read, write)
    got = native.conv_update_native(x, weight, pool, read, write, level=level)
    assert_same_outputs(got, want)
    assert torch.equal(pool, want_pool)                  # the windows are copies: bitwise, every slot


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), B=st.integers(1, 5), T=st.integers(1, 8), D=st.integers(1, 70),
       K=st.sampled_from([2, 3, 4]), dtype=st.sampled_from(DTYPES), data=st.data())
def test_any_slots_match_the_torch_form(level, seed, B, T, D, K, dtype, data):
    """Slots drawn freely: rows reading one slot, writing each other's read slots, padding and
    repeats along t anywhere; only two rows writing one slot at the same token is left out (the
    torch form's index_copy_ does not define which wins)."""
    g = torch.Generator().manual_seed(seed)
    S = data.draw(st.integers(1, 2 * B * T + 2), label="pool slots")
    x = (torch.randn(B, T, D, generator=g) * 3).to(dtype)
    weight = torch.randn(D, K, generator=g).to(dtype)
    pool = torch.randn(S, D, K - 1, generator=g).to(dtype)
    read = torch.tensor(data.draw(st.lists(st.integers(0, S - 1), min_size=B, max_size=B), label="read"))
    # per token, B distinct draws of S + B values, those past the pool being padding (-1)
    columns = [[s if s < S else -1 for s in data.draw(st.permutations(range(S + B)), label=f"write t={t}")[:B]]
               for t in range(T)]
    write = torch.tensor(columns).t().contiguous()
    want_pool = pool.clone()
    want = causal_conv1d_update_torch(x, weight, want_pool, read, write)
    got = native.conv_update_native(x, weight, pool, read, write, level=level)
    assert_same_outputs(got, want)
    assert torch.equal(pool, want_pool)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_native_takes_a_weight_of_the_other_dtype(dtype, weight_dtype):
    x, weight, pool, read, write = _case(8, 3, 2, 40, 4, dtype, weight_dtype)
    want_pool = pool.clone()
    want = causal_conv1d_update_torch(x, weight, want_pool, read, write)
    assert_same_outputs(native.conv_update_native(x, weight, pool, read, write), want)
    assert torch.equal(pool, want_pool)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_reads_a_column_slice_in_place():
    """x as the layer hands it over: the conv's columns of the projection, rows strided."""
    x, weight, pool, read, write = _case(9, 3, 3, 48, 4, torch.float32)
    wide = torch.randn(3, 3, 80)
    wide[..., 16:64] = x
    sliced = wide[..., 16:64]
    assert not sliced.is_contiguous()
    want_pool = pool.clone()
    want = native.conv_update_native(x, weight, want_pool, read, write)
    assert torch.equal(native.conv_update_native(sliced, weight, pool, read, write), want)
    assert torch.equal(pool, want_pool)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_refuses_slots_outside_the_pool():
    x, weight, pool, _, _ = _case(10, 1, 2, 20, 4, torch.float32)
    pool = pool[:8].clone()
    before = pool.clone()
    for read, write in (([8], [[0, 1]]), ([0], [[1, 8]]), ([-1], [[1, 2]])):
        with pytest.raises(ValueError, match="a slot outside the pool"):
            native.conv_update_native(x, weight, pool, torch.tensor(read), torch.tensor(write))
    assert torch.equal(pool, before)


def test_native_declines_what_it_cannot_take():
    x, weight, pool = torch.zeros(1, 1, 8), torch.zeros(8, 4), torch.zeros(3, 8, 3)
    assert not native.can_run_native(x.double(), weight, pool.double())
    assert not native.can_run_native(x, torch.zeros(8, 5), torch.zeros(3, 8, 4))     # K = 5
    assert not native.can_run_native(x, weight, pool.bfloat16())                    # pool of another dtype
    assert not native.can_run_native(x, weight, torch.zeros(3, 3, 8).transpose(1, 2))   # a strided pool
    assert not native.can_run_native(torch.zeros(1, 8, 2).transpose(1, 2)[:, :1], weight, pool)  # strided channels
    assert native.can_run_native(x, weight, pool) == bool(NATIVE_LEVELS)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_update_takes_the_kernel_where_it_runs(dtype, compiled):
    """At a native level causal_conv1d_update calls the kernel (eagerly, and as one op of a
    compiled graph); at level none the torch form. The result is the torch form's either way."""
    x, weight, pool, read, write = _case(11, 3, 3, 40, 4, dtype)
    want_pool = pool.clone()
    want = causal_conv1d_update_torch(x, weight, want_pool, read, write)
    op = causal_conv1d_update
    if compiled:
        op = torch.compile(op, backend="eager", fullgraph=True, dynamic=False)   # tracing, one graph
    # the step's rows, as the engine hands them down (the torch form would read them back)
    with recorded_calls("causal_conv1d_update") as calls:
        got = op(x, weight, pool, read, write, DecodeRows.of_tensors(read, write))
    assert bool(calls) == (cpu_level() != "none")
    assert_same_outputs(got, want)
    assert torch.equal(pool, want_pool)


# ---------------------------------------------------------------- the engine on the kernel

def _counting_kernel(monkeypatch):
    """Counts the kernel's calls by tokens per row (1: decode, k + 1: verify), where the layer
    calls the op (the engine's steps run on a thread of their own, which a profiler started
    here would not see). The fused decode op (kernels/gdn/decode_cpu.py, which runs this
    kernel inside it; tests/test_native_gdn_decode.py) is turned off, so that the layer calls
    the conv update on its own."""
    monkeypatch.setattr(native_gdn_decode, "can_run_native", lambda *a: False)
    calls = {}
    kernel = native.conv_update_op

    def counted(x, *rest):
        calls[x.shape[1]] = calls.get(x.shape[1], 0) + 1
        return kernel(x, *rest)

    monkeypatch.setattr(native, "conv_update_op", counted)
    return calls


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_greedy_tokens_match_transformers_on_the_kernel(tmp_path, monkeypatch):
    hf = make_hf_model("qwen3_5", full_attention_interval=2)
    save_checkpoint(hf, tmp_path)
    calls = _counting_kernel(monkeypatch)
    assert_greedy_matches_transformers(LLM(model=str(tmp_path), dtype="float32", block_size=16), hf)
    assert calls.get(1, 0) > 0


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_verify_on_the_kernel_equals_the_torch_form(tmp_path, monkeypatch, dtype):
    """Speculative runs (verify steps of k + 1 tokens per row) give the same tokens with the
    kernel as with the torch form, and as the plain path without speculation."""
    folder = str(make_spec_checkpoint(tmp_path, embed_scale=1.6))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tokens = functools.partial(greedy_tokens, folder, dtype)

    calls = _counting_kernel(monkeypatch)
    on_kernel = tokens(speculative_config=spec)
    plain_on_kernel = tokens()
    assert calls.get(3, 0) > 0 and calls.get(1, 0) > 0
    monkeypatch.setattr(native, "can_run_native", lambda *a: False)
    calls.clear()
    assert tokens(speculative_config=spec) == on_kernel
    assert tokens() == plain_on_kernel
    assert not calls
    assert on_kernel == plain_on_kernel
