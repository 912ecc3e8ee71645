"""kernels/gdn/gdn_recurrent.cpp: decode and verify steps == the torch forms and the rule itself."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.kernels.gdn import recurrent
from hybrid_engine.kernels.gdn import recurrent_cpu as native_recurrent
from hybrid_engine.kernels.gdn.recurrent import _decode_in_place, _steps
from hybrid_engine.kernels.gdn.recurrent_cpu import can_run_native, gdn_recurrent_native
from hybrid_engine.kernels.native.isa import at_least
from hybrid_engine.kernels.slot_pool import DecodeRows, rows_independent
from hybrid_engine.kernels.native.compile_marks import mark_native_checks

mark_native_checks()     # compiled ops' routing checks are constants to dynamo, as in compiled steps

pytestmark = pytest.mark.skipif(not at_least("avx2"), reason="level none: no native kernel")


def _inputs(B, T, H, dk, dv, seed):
    g = torch.Generator().manual_seed(seed)
    kq = torch.nn.functional.normalize(torch.randn(B, T, H, 2, dk, generator=g), dim=-1)
    decay = torch.rand(B, T, H, generator=g) * 0.5 + 0.5
    beta = torch.rand(B, T, H, generator=g)
    v = torch.randn(B, T, H, dv, generator=g)
    pool = torch.randn(3 * B * T + 2, H, dk, dv, generator=g)
    return kq, decay, beta, v, pool, g


@pytest.mark.parametrize("B,H,dk,dv", [(1, 1, 16, 16), (3, 4, 32, 32), (5, 2, 128, 128), (2, 3, 24, 48)])
def test_native_decode_matches_the_torch_in_place_form(B, H, dk, dv):
    kq, decay, beta, v, pool, g = _inputs(B, 1, H, dk, dv, seed=B * 100 + dk)
    assert can_run_native(pool)
    slots = torch.randperm(pool.shape[0], generator=g)[:B]
    want_pool = pool.clone()
    qk = (kq[:, 0, :, 0] * kq[:, 0, :, 1]).sum(-1)[..., None, None]
    want = _decode_in_place(kq[:, 0], qk, decay[:, 0, :, None, None], beta[:, 0, :, None, None],
                            v[:, 0, :, None, :], want_pool, slots.tolist()).view(B, 1, H, dv)
    got = gdn_recurrent_native(kq, decay, beta, v, pool, slots, slots[:, None])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)   # other slots untouched too


def test_native_decode_follows_the_rule():
    """S' = a S + k u^T, u = beta (v - a S^T k), o = S'^T q for one head, from scratch."""
    dk, dv = 32, 48
    kq, decay, beta, v, pool, g = _inputs(1, 1, 1, dk, dv, seed=7)
    s0 = pool[3, 0].clone()
    o = gdn_recurrent_native(kq, decay, beta, v, pool, torch.tensor([3]), torch.tensor([[4]]))
    k, q, a = kq[0, 0, 0, 0], kq[0, 0, 0, 1], decay[0, 0, 0]
    u = beta[0, 0, 0] * (v[0, 0, 0] - a * (s0.t() @ k))
    s1 = a * s0 + torch.outer(k, u)
    torch.testing.assert_close(pool[4, 0], s1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool[3, 0], s0, rtol=0, atol=0)              # the read slot is kept
    torch.testing.assert_close(o[0, 0, 0], s1.t() @ q, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,T,H,dk,dv", [(1, 5, 4, 32, 32), (3, 4, 2, 128, 128), (4, 2, 3, 24, 48)])
def test_native_verify_matches_the_torch_general_form(B, T, H, dk, dv):
    """A verify step as the engine lays it out: token 0 written back to the read slot, later
    tokens to draft slots; one row with padding (skipped writes) in the middle and at the end."""
    kq, decay, beta, v, pool, g = _inputs(B, T, H, dk, dv, seed=B * 10 + T)
    perm = torch.randperm(pool.shape[0], generator=g)
    read = perm[:B]
    write = torch.cat([read[:, None], perm[B:B + B * (T - 1)].view(B, T - 1)], 1)
    write[-1, T // 2:] = -1
    if T > 2:
        write[0, 1] = -1
    assert rows_independent(read.tolist(), write.tolist())
    want_pool = pool.clone()
    want = _steps(kq, decay, beta, v, want_pool, read, write)
    got = gdn_recurrent_native(kq, decay, beta, v, pool, read, write)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)


def test_rows_independent_refuses_what_parallel_rows_would_race_on():
    assert rows_independent([4, 7], [[4, 1], [7, 2]])
    assert rows_independent([4], [[9, 4, 4]])                  # one row: any order is its own
    assert not rows_independent([4, 7], [[4, 7], [7, 2]])      # row 0 writes row 1's read slot
    assert not rows_independent([4, 4], [[1], [2]])            # two rows read one slot
    assert not rows_independent([-1, 7], [[-1], [7]])          # a padded read


def test_the_op_takes_rows_that_depend_on_each_other():
    """Rows that write another row's read slot, or share a read slot, start from a copy of their
    states gathered first (as the torch form's gather): equal to the torch form, and the rows'
    reads see the states from before the step."""
    B, T, H, dk, dv = 3, 2, 2, 16, 16
    kq, decay, beta, v, pool, _ = _inputs(B, T, H, dk, dv, seed=3)
    for read, write in (([0, 1, 2], [[1, 5], [2, 6], [7, 8]]),      # each row writes the next one's read slot
                        ([4, 4, 9], [[4, 10], [11, 12], [13, 14]])):  # two rows read one slot
        read, write = torch.tensor(read), torch.tensor(write)
        assert not rows_independent(read.tolist(), write.tolist())
        want_pool = pool.clone()
        want = _steps(kq, decay, beta, v, want_pool, read, write)
        got_pool = pool.clone()
        got = gdn_recurrent_native(kq, decay, beta, v, got_pool, read, write)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)


def test_the_cpu_backend_takes_the_torch_form_for_rows_known_to_depend(monkeypatch):
    """With the step's DecodeRows saying the rows depend on each other (the padded rows of
    captured graphs), the cpu backend's recurrent_gated_delta_rule takes the torch form; otherwise the kernel."""
    B, T, H, dk, dv = 2, 2, 2, 16, 16
    kq, decay, beta, v, pool, _ = _inputs(B, T, H, dk, dv, seed=3)
    q, k = kq[..., 1, :].contiguous(), kq[..., 0, :].contiguous()
    read, write = torch.tensor([0, 1]), torch.tensor([[1, 2], [3, 4]])
    calls = []
    native = native_recurrent.gdn_recurrent_native
    monkeypatch.setattr(native_recurrent, "gdn_recurrent_native", lambda *a: calls.append(1) or native(*a))
    for rows, uses_kernel in ((DecodeRows.of_tensors(read, write), False), (None, True)):
        want_pool = pool.clone()
        want = recurrent._steps(recurrent.normalize_kq(q, k, H, None, True), decay, beta, v, want_pool, read, write)
        calls.clear()
        got_pool = pool.clone()
        got = native_recurrent.recurrent_gated_delta_rule(q, k, v, decay.log(), beta, got_pool, read, write, rows=rows)
        assert calls == ([1] if uses_kernel else [])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)


def test_native_refuses_slots_outside_the_pool():
    kq, decay, beta, v, pool, _ = _inputs(1, 2, 1, 16, 16, seed=1)       # 8 slots
    before = pool.clone()
    for read, write in (([8], [[0, 1]]), ([0], [[1, 8]]), ([-1], [[1, 2]])):
        with pytest.raises(ValueError, match="outside the pool of 8"):
            gdn_recurrent_native(kq, decay, beta, v, pool, torch.tensor(read), torch.tensor(write))
    assert torch.equal(pool, before)


def test_native_declines_what_it_cannot_take():
    assert not can_run_native(torch.zeros(2, 1, 8, 40))                 # dv not a multiple of 16
    assert not can_run_native(torch.zeros(2, 1, 8, 32, dtype=torch.float64))


def test_compiled_graphs_call_the_kernel_as_one_op():
    """Under torch.compile the rule is the op hybrid_engine_cpu::gdn_recurrent, one call in the
    graph (C++: no Python at run time), for independent rows and for rows that depend on each
    other alike; both equal to the torch form."""
    B, T, H, dk, dv = 2, 3, 4, 32, 32
    kq, decay, beta, v, pool, _ = _inputs(B, T, H, dk, dv, seed=11)
    q, k = kq[..., 1, :].contiguous(), kq[..., 0, :].contiguous()
    compiled = torch.compile(native_recurrent.recurrent_gated_delta_rule, fullgraph=True)
    for read, write in (([1, 4], [[1, 6, 7], [4, 8, 9]]), ([0, 1], [[1, 2, 3], [5, 6, 7]])):
        read, write = torch.tensor(read), torch.tensor(write)
        want_pool = pool.clone()
        want = recurrent._steps(recurrent.normalize_kq(q, k, H, None, True), decay, beta, v, want_pool,
                                read, write)
        compiled(q, k, v, decay.log(), beta, pool.clone(), read, write)       # traced (fakes) here
        got_pool = pool.clone()
        with torch.profiler.profile() as prof:
            got = compiled(q, k, v, decay.log(), beta, got_pool, read, write)
        ops = [e.name for e in prof.events() if e.name.startswith("hybrid_engine_cpu::")]
        assert ops == ["hybrid_engine_cpu::gdn_recurrent"]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_pool, want_pool, rtol=1e-5, atol=1e-5)
