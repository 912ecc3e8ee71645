"""kernels/gdn/gdn_decode.cpp (with the conv update before it): the GDN layer's decode/verify step
from its projections == the torch form (kernels/gdn/decode.py `gdn_decode_torch`, run on the plain
torch ops) at every native level this process may run; `gdn_decode` takes the op (eager and
traced) where it runs and the torch form where it does not; and the engine's greedy tokens
(plain decode and MTP verify) are the same on it as on the torch form, and as transformers'."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybrid_engine import LLM
from hybrid_engine.kernels import gdn
from hybrid_engine.kernels.gdn import decode_cpu as native
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
            "test_gdn_decode_takes_the_op_where_it_runs checks the torch form there"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture
def torch_forms():
    """The reference: the torch backend's gdn_decode, the plain torch ops in sequence."""
    return gdn.gdn_decode_torch


class Case:
    """A layer's inputs as the layer hands them over: mixed, b and a column slices of one
    projection output (rows strided), slots as a verify step lays them out (token 0 back to the
    read slot, later tokens to other slots) with a padded tail in the last row."""

    def __init__(self, seed, B, T, Hk, Hv, dk, dv, K, dtype, weight_dtype=None, bias_dtype=None):
        g = torch.Generator().manual_seed(seed)
        D = 2 * Hk * dk + Hv * dv
        proj = (torch.randn(B, T, D + 2 * Hv + 3, generator=g) * 2).to(dtype)
        self.mixed, self.b, self.a = proj[..., :D], proj[..., D:D + Hv], proj[..., D + Hv:D + 2 * Hv]
        self.conv_weight = (torch.randn(D, K, generator=g) * 0.5).to(weight_dtype or dtype)
        self.dt_bias = torch.randn(Hv, generator=g).to(bias_dtype or dtype)
        # -exp(A_log), A_log over log(0.01 .. 16) as the checkpoints' range
        self.neg_decay_rate = -torch.empty(Hv).uniform_(0.01, 16, generator=g)
        S = 2 * B * T + 3
        self.conv_pool = torch.randn(S, D, K - 1, generator=g).to(dtype)
        self.state_pool = torch.randn(S, Hv, dk, dv, generator=g) * 0.1
        perm = torch.randperm(S, generator=g)
        self.read = perm[:B]
        self.write = torch.cat([self.read[:, None], perm[B:B + B * (T - 1)].view(B, T - 1)], 1)
        if T > 1:
            self.write[-1, T // 2:] = -1
        self.scale = dk ** -0.5

    def run(self, op, **kwargs):
        """op (a gdn_decode form) on copies of the pools -> (o, conv pool, state pool)."""
        conv_pool, state_pool = self.conv_pool.clone(), self.state_pool.clone()
        o = op(self.mixed, self.b, self.a, self.conv_weight, self.dt_bias, self.neg_decay_rate, conv_pool,
               state_pool, self.read, self.write, self.scale, **kwargs)
        return o, conv_pool, state_pool


def native_at(level):
    """The op at `level` in gdn_decode's argument order."""
    def op(mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_pool, state_pool, read, write, scale):
        return native.gdn_decode_native(mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate, state_pool,
                                        read, write, scale, level=level)
    return op


def assert_same(got, want):
    """o: float32 within 1e-5 (the q/k norm's and the gates' sums and libm calls differ from
    torch's by an ulp); bf16 within one bf16 ulp (an fp32 ulp apart before the rounding); the
    conv windows bitwise (copies); the states within 1e-5."""
    (o, conv_pool, state_pool), (o_want, conv_want, state_want) = got, want
    assert o.dtype == o_want.dtype and o.shape == o_want.shape
    if o.dtype == torch.float32:
        torch.testing.assert_close(o, o_want, rtol=1e-5, atol=1e-5)
    else:
        ulps = (o.view(torch.int16).int() - o_want.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, f"{int((ulps > 1).sum())} outputs more than one bf16 ulp apart"
    assert torch.equal(conv_pool, conv_want)
    torch.testing.assert_close(state_pool, state_want, rtol=1e-5, atol=1e-5)


CASES = [  # seed, B, T, Hk, Hv, dk, dv, K
    (1, 1, 1, 16, 16, 128, 128, 4),    # batch-1 decode at Qwen3.5-0.8B's dims
    (2, 1, 1, 2, 4, 32, 32, 4),        # the default model's: two value heads per key head
    (3, 3, 4, 2, 4, 32, 32, 4),        # verify k = 3, a padded tail
    (4, 2, 3, 1, 2, 16, 48, 3),        # dk != dv, K = 3
    (5, 4, 2, 3, 3, 24, 16, 2),        # dk not a multiple of a vector, K = 2
]


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, B, T, Hk, Hv, dk, dv, K", CASES)
def test_native_matches_the_torch_form(torch_forms, level, dtype, seed, B, T, Hk, Hv, dk, dv, K):
    case = Case(seed, B, T, Hk, Hv, dk, dv, K, dtype)
    assert native.can_run_native(case.mixed, case.b, case.a, case.conv_weight, case.conv_pool, case.state_pool)
    assert_same(case.run(native_at(level)), case.run(torch_forms))


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("dtype, weight_dtype, bias_dtype", [(torch.bfloat16, torch.float32, torch.float32),
                                                             (torch.float32, torch.bfloat16, torch.bfloat16)])
def test_native_takes_weights_of_the_other_dtype(torch_forms, dtype, weight_dtype, bias_dtype):
    case = Case(6, 2, 2, 2, 4, 32, 32, 4, dtype, weight_dtype, bias_dtype)
    assert_same(case.run(native_at(None)), case.run(torch_forms))


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_gates_at_their_ends(torch_forms, dtype):
    """softplus past its threshold (its linear branch) and far below, sigmoid saturated."""
    case = Case(7, 2, 3, 2, 4, 32, 32, 4, dtype)
    case.a[0, 0] = torch.tensor([30.0, 19.5, -30.0, 0.0]).to(dtype)
    case.b[1, 2] = torch.tensor([40.0, -40.0, 8.0, -8.0]).to(dtype)
    assert_same(case.run(native_at(None)), case.run(torch_forms))


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_output_does_not_depend_on_the_thread_count():
    """At 0.8B dims the call runs on two threads where it may: bitwise what one thread gives."""
    case = Case(8, 2, 2, 16, 16, 128, 128, 4, torch.bfloat16)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = case.run(native_at(None))
        torch.set_num_threads(2)
        two = case.run(native_at(None))
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(x, y) for x, y in zip(one, two))


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2 ** 31 - 1), B=st.integers(1, 4), T=st.integers(1, 4), groups=st.sampled_from([1, 2]),
       dtype=st.sampled_from(DTYPES), data=st.data())
def test_any_slots_match_the_torch_form(level, seed, B, T, groups, dtype, data):
    """Slots drawn freely: rows reading one slot, writing each other's read slots (the op
    gathers those rows' first states), padding and repeats along a row anywhere; only two rows
    writing one slot is left out (the rule's contract: rows run in parallel)."""
    case = Case(seed, B, T, 2, 2 * groups, 16, 16, 4, dtype)
    S = data.draw(st.integers(1, 2 * B * T + 2), label="pool slots")
    case.conv_pool, case.state_pool = case.conv_pool[:S].clone(), case.state_pool[:S].clone()
    case.read = torch.tensor(data.draw(st.lists(st.integers(0, S - 1), min_size=B, max_size=B), label="read"))
    drawn = data.draw(st.permutations(range(S + B * T)), label="write")[:B * T]
    write = [[s if s < S else -1 for s in drawn[b * T:(b + 1) * T]] for b in range(B)]
    for b, t in data.draw(st.lists(st.tuples(st.integers(0, B - 1), st.integers(1, T)), max_size=3),
                          label="repeats along a row"):
        if t < T:
            write[b][t] = write[b][t - 1]
    case.write = torch.tensor(write)
    want = case.run(gdn.gdn_decode_torch)
    assert_same(case.run(native_at(level)), want)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_refuses_slots_outside_the_pool():
    case = Case(9, 1, 2, 2, 4, 16, 16, 4, torch.float32)
    case.conv_pool = torch.randn(8, *case.conv_pool.shape[1:])             # 8 conv slots, more states
    case.state_pool = torch.randn(12, *case.state_pool.shape[1:])
    for read, write in (([8], [[0, 1]]), ([0], [[1, 8]]), ([-1], [[1, 2]])):
        case.read, case.write = torch.tensor(read), torch.tensor(write)
        conv_before, state_before = case.conv_pool.clone(), case.state_pool.clone()
        with pytest.raises(ValueError, match="a slot outside the pool of 8"):
            native_at(None)(case.mixed, case.b, case.a, case.conv_weight, case.dt_bias, case.neg_decay_rate,
                            case.conv_pool, case.state_pool, case.read, case.write, case.scale)
        assert torch.equal(case.conv_pool, conv_before) and torch.equal(case.state_pool, state_before)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_refuses_heads_it_cannot_take_before_the_conv():
    """dv not a multiple of 16: refused with both pools as they were (the conv runs first)."""
    case = Case(12, 1, 1, 1, 1, 16, 40, 4, torch.float32)
    conv_before, state_before = case.conv_pool.clone(), case.state_pool.clone()
    with pytest.raises(ValueError, match="dv a multiple of 16"):
        native_at(None)(case.mixed, case.b, case.a, case.conv_weight, case.dt_bias, case.neg_decay_rate,
                        case.conv_pool, case.state_pool, case.read, case.write, case.scale)
    assert torch.equal(case.conv_pool, conv_before) and torch.equal(case.state_pool, state_before)


def test_native_declines_what_it_cannot_take():
    case = Case(10, 1, 1, 2, 4, 16, 16, 4, torch.float32)
    args = [case.mixed, case.b, case.a, case.conv_weight, case.conv_pool, case.state_pool]

    def can_run(**changes):
        names = ["mixed", "b", "a", "conv_weight", "conv_pool", "state_pool"]
        return native.can_run_native(*(changes.get(n, x) for n, x in zip(names, args)))

    assert can_run() == bool(NATIVE_LEVELS)
    assert not can_run(mixed=case.mixed.double())
    assert not can_run(b=case.b.bfloat16())                               # gates of another dtype
    assert not can_run(conv_pool=case.conv_pool.bfloat16())
    assert not can_run(state_pool=case.state_pool.bfloat16())
    assert not can_run(conv_weight=torch.zeros(case.mixed.shape[-1], 5))   # K = 5
    assert not can_run(state_pool=torch.zeros(3, 4, 16, 40))              # dv not a multiple of 16
    assert not can_run(state_pool=torch.zeros(3, 3, 16, 16))              # 3 value heads over 2.5 key heads


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gdn_decode_takes_the_op_where_it_runs(torch_forms, dtype, compiled):
    """At a native level gdn_decode is the one op (no conv or rule op beside it), eager and in a
    compiled graph alike, bitwise the torch form's result; level none takes the torch form."""
    case = Case(11, 2, 3, 2, 4, 32, 32, 4, dtype)
    want = case.run(torch_forms)
    op = native.gdn_decode
    rows = DecodeRows.of_tensors(case.read, case.write)                # as the engine hands them down
    if compiled:
        op = torch.compile(op, fullgraph=True, dynamic=False)
        case.run(op, rows=rows)                                         # traced (fakes) here
    with torch.profiler.profile() as prof:
        got = case.run(op, rows=rows)
    ops = [e.name for e in prof.events() if e.name.startswith("hybrid_engine_cpu")]
    assert ops == (["hybrid_engine_cpu::gdn_decode"] if cpu_level() != "none" else [])
    if compiled and cpu_level() == "none" and dtype == torch.bfloat16:
        # level none compiles the torch form, and inductor's fusion of it keeps some of the eager
        # form's bf16 roundings in float32
        torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
        assert torch.equal(got[1], want[1])                             # the windows: copies
        torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-2)
    else:
        assert_same(got, want)


# ---------------------------------------------------------------- the engine on the op

def _counting_op(monkeypatch):
    """Counts the op's calls by tokens per row (1: decode, k + 1: verify), where the layer calls
    it (the engine's steps run on a thread of their own, which a profiler started here would
    not see)."""
    calls = {}
    op = native.gdn_decode_op

    def counted(mixed, *rest, **kwargs):
        calls[mixed.shape[1]] = calls.get(mixed.shape[1], 0) + 1
        return op(mixed, *rest, **kwargs)

    monkeypatch.setattr(native, "gdn_decode_op", counted)
    return calls


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_greedy_tokens_match_transformers_on_the_op(tmp_path, monkeypatch):
    hf = make_hf_model("qwen3_5", full_attention_interval=2)
    save_checkpoint(hf, tmp_path)
    calls = _counting_op(monkeypatch)
    assert_greedy_matches_transformers(LLM(model=str(tmp_path), dtype="float32", block_size=16), hf)
    assert calls.get(1, 0) > 0


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_verify_on_the_op_equals_the_torch_form(tmp_path, monkeypatch, dtype):
    """Speculative runs (verify steps of k + 1 tokens per row) give the same tokens on the op as
    on the torch forms, and as the plain path without speculation."""
    folder = str(make_spec_checkpoint(tmp_path, embed_scale=1.6))
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tokens = functools.partial(greedy_tokens, folder, dtype)

    calls = _counting_op(monkeypatch)
    on_op = tokens(speculative_config=spec)
    plain_on_op = tokens()
    assert calls.get(3, 0) > 0 and calls.get(1, 0) > 0
    monkeypatch.setattr(native, "can_run_native", lambda *a: False)
    calls.clear()
    assert tokens(speculative_config=spec) == on_op
    assert tokens() == plain_on_op
    assert not calls
    assert on_op == plain_on_op
