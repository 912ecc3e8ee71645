"""kernels/linear/cpu.py and models/linear.py: every layout chosen for a projection, at the
process's CPU level (run this file with HYBRID_ENGINE_CPU_ISA=avx512|avx2|none too), computes
x W^T; the native blocked kernel (kernels/linear/blocked_linear.cpp) against F.linear."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from hybrid_engine.kernels.linear import blocked as blocked_mod
from hybrid_engine.kernels.linear.blocked import block_weight, blocked_linear, blocked_linear_reference, native_available
from hybrid_engine.kernels.linear import cpu as projection_mod
from hybrid_engine.kernels.native.ops import native_ops
from hybrid_engine.kernels.native.isa import at_least, onednn_packs
from hybrid_engine.kernels.activation import silu_mul_torch
from hybrid_engine.kernels.activation.cpu import silu_mul
from hybrid_engine.kernels.linear.cpu import (BlockedProjection, FewRowsSplit, OneDNNProjection, PlainProjection,
                                                  WideningProjection, choose_projection, fused_swiglu)
from hybrid_engine.kernels.linear.cpu import CpuLinearMethod, Projection
from hybrid_engine.kernels.backends import CpuBackend
from hybrid_engine.kernels.linear import LinearMethod, plain_linear
from hybrid_engine.models.linear import Linear

from op_calls import recorded_calls

needs_native = pytest.mark.skipif(not at_least("avx2"), reason="level none: no native kernel")
needs_onednn_bf16 = pytest.mark.skipif(not onednn_packs(torch.bfloat16), reason="no oneDNN bf16 packing at this level")


def linear(x: torch.Tensor, weight: torch.Tensor | Projection) -> torch.Tensor:
    """x W^T from a plain weight or a chosen projection."""
    return weight(x) if isinstance(weight, Projection) else plain_linear(x, weight)


def loaded_layer(weight: torch.Tensor, method: LinearMethod | None = None) -> Linear:
    """A projection layer of `weight`'s shape loaded with it and processed by `method` (the cpu
    backend's by default), as models/load.py does."""
    with torch.device("meta"):
        layer = Linear(weight.shape[1], weight.shape[0], method=method or CpuLinearMethod())
    layer.weight_loader("w.weight", weight)
    layer.process_weights_after_loading()
    return layer


@pytest.fixture
def block_every_size(monkeypatch):
    monkeypatch.setattr(projection_mod, "BLOCKED_MIN_BYTES", 0)   # (small bf16 weights get no few-rows copy by default)


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 16, 32, 33, 64])
def test_plain_linear_matches_f_linear_at_every_row_count(rows):
    # 8..32 rows take the transposed float32 product, the others F.linear
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    x = torch.randn(rows, 96, generator=g)
    out = plain_linear(x, w)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w), out, rtol=0, atol=0)


def expected_layout(dtype: torch.dtype, onednn: bool, few_rows_copy: bool) -> type:
    """The policy of kernels/linear/cpu.py, spelled out per level for a blockable weight."""
    if dtype == torch.float32:
        return BlockedProjection if native_available() else PlainProjection
    if not onednn_packs(dtype):
        if not (native_available() and dtype == torch.bfloat16):
            return PlainProjection
        return BlockedProjection if at_least("avx512_bf16") else WideningProjection
    if few_rows_copy and dtype == torch.bfloat16 and native_available():
        return FewRowsSplit
    return OneDNNProjection if onednn else PlainProjection


@pytest.mark.parametrize("onednn", [True, False])
def test_small_bf16_weights_run_the_kernel_up_to_16_rows(onednn):
    """A 150 KB bf16 weight (the default model's mtp.fc): where oneDNN packs bf16 its blocked
    copy serves up to SMALL_FEW_ROWS rows (decode and MTP verify: a row the same bits in either),
    oneDNN (or a compiled step's plain product) more; where it does not, the kernel every row
    count (module docstring of kernels/linear/cpu.py)."""
    w = torch.randn(192, 384, generator=torch.Generator().manual_seed(0)).bfloat16()
    layout = choose_projection(w, onednn=onednn)
    if not native_available():
        assert type(layout) is PlainProjection
        return
    x = torch.randn(40, 384, generator=torch.Generator().manual_seed(1)).bfloat16()
    if onednn_packs(torch.bfloat16):
        assert type(layout) is FewRowsSplit and layout.max_rows == projection_mod.SMALL_FEW_ROWS == 16
        assert type(layout.many) is (OneDNNProjection if onednn else PlainProjection)
        few = x[:16]
    else:
        assert type(layout) is (BlockedProjection if at_least("avx512_bf16") else WideningProjection)
        few = x
    torch.testing.assert_close(layout(x).float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
    assert torch.equal(layout(few), torch.cat([layout(few[i:i + 1]) for i in range(few.shape[0])]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize("few_rows_copy", [True, False])
def test_the_chosen_projection_matches_f_linear_at_this_level(block_every_size, dtype, onednn, few_rows_copy):
    """bf16 and fp16 work at every level: oneDNN's packing only where torch's check and the
    level allow it (on AVX2-only CPUs the reorder raises), the blocked kernel or F.linear else."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g).to(dtype)
    proj = choose_projection(w, onednn=onednn, few_rows_copy=few_rows_copy)
    assert type(proj) is expected_layout(dtype, onednn, few_rows_copy)
    if isinstance(proj, FewRowsSplit):
        assert type(proj.many) is (OneDNNProjection if onednn else PlainProjection)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 4, 5, 16, 64):
        x = torch.randn(rows, 80, generator=g).to(dtype)
        out = proj(x)
        assert out.dtype == dtype and out.shape == (rows, 96)
        torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_off_the_cpu_or_unblockable_stay_plain(block_every_size, dtype):
    assert type(choose_projection(torch.randn(32, 24, device="meta").to(dtype))) is PlainProjection
    assert type(choose_projection(torch.randn(32, 24, dtype=torch.float64))) is PlainProjection


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(20, 24), (392, 192), (9, 37)])     # the default model's GDN in_proj: 392
def test_rows_off_the_block_are_padded_and_cropped(block_every_size, dtype, n, k):
    """A weight whose row count is not a multiple of 16 is blocked with zero rows after it: the
    product has exactly its n columns, contiguous, at every row count and in every form."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g).to(dtype)
    proj = choose_projection(w, onednn=False, few_rows_copy=True)
    blocked = proj.few if isinstance(proj, FewRowsSplit) else proj
    assert isinstance(blocked, BlockedProjection) and blocked.blocked.shape[0] == -(-n // 16)
    tol = 1e-4 if dtype == torch.float32 else 2e-2      # sums of up to 192 products of N(0, 1)
    for rows in (1, 3, 17, 40):
        x = torch.randn(rows, k, generator=g).to(dtype)
        for form in {proj, blocked}:
            out = form(x)
            assert out.shape == (rows, n) and out.is_contiguous()
            torch.testing.assert_close(out.float(), F.linear(x.float(), w.float()), rtol=tol, atol=tol)
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(blocked.rows(ids), w[ids])


# ---- the native blocked kernel (kernels/linear/blocked_linear.cpp) -------------------------------

@needs_native
def test_native_kernel_builds_where_the_cpu_can_run_it():
    # a build failure would otherwise only show as slower products (every caller falls back)
    assert native_available()


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 15, 16, 17, 31, 33, 64, 100])
@pytest.mark.parametrize("n", [16, 48, 80, 336])        # 1, 3, 5, 21 blocks: every tile width and tail
def test_blocked_float32_matches_f_linear(rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    w = torch.randn(n, 37, generator=g)                   # odd K
    x = torch.randn(rows, 37, generator=g)
    wb = block_weight(w)
    assert wb.shape == (n // 16, 37, 16)
    out = blocked_linear(x, wb)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(blocked_linear_reference(x, wb), F.linear(x, w), rtol=1e-5, atol=1e-5)


@needs_native
@pytest.mark.parametrize("rows,k,threads", [(64, 37, 2), (70, 1100, 2), (1030, 1100, 3), (515, 512, 1)])
def test_blocked_float32_many_rows_at_avx2_equals_each_row_alone(rows, k, threads):
    """From 64 rows on, the AVX2 build runs its K-sliced form (6-row tiles, y reloaded after each
    slice of 512 k, rows in blocks of at most 512): the same FMAs in k order as the few-rows form,
    so every row equals its product in a call of 4 rows, bitwise. The AVX2 build is loaded
    explicitly, so the default run (at the native level) covers it too. Shapes: a partial last
    panel (70), several slices with a short last one (1100), several row blocks (515, 1030),
    threads splitting 3 blocks unevenly."""
    product = native_ops("avx2").linear_blocked.default
    g = torch.Generator().manual_seed(rows + k)
    n = 48
    w = torch.randn(n, k, generator=g)
    x = torch.randn(rows, k, generator=g)
    wb = block_weight(w)

    def run(xs: torch.Tensor) -> torch.Tensor:
        return product(xs, wb, False)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)          # the op runs on torch's thread count
    try:
        many = run(x)
        few = torch.cat([run(x[i:i + 4].contiguous()) for i in range(0, rows, 4)])
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(many, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-4)
    assert torch.equal(many, few)


@needs_native
@pytest.mark.parametrize("level", ["native", "avx2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_few_rows_equal_each_row_alone_bitwise(level, dtype):
    """Every tile shape (1-4 rows: 4, 3 or 2 blocks wide; panels of 5-6 or 8 rows) runs the same
    FMA chain per output: a row's product is the same bits at any row count. MTP verify's rows
    must equal plain decode's one row for speculation to stay lossless. The AVX2 build is loaded
    explicitly, so an AVX-512 machine covers its tiles too."""
    product = (native_ops() if level == "native" else native_ops("avx2")).linear_blocked.default
    g = torch.Generator().manual_seed(7)
    n, k = 336, 192                                       # 21 blocks: every tile width and a tail
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(17, k, generator=g).to(dtype)
    wb = block_weight(w)
    alone = torch.cat([product(x[i:i + 1].contiguous(), wb, False) for i in range(17)])
    for rows in range(2, 18):
        assert torch.equal(product(x[:rows].contiguous(), wb, False), alone[:rows]), rows


@needs_native
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 16, 40])
@pytest.mark.parametrize("n,k", [(96, 128), (96, 37), (80, 64)])   # odd K: the last pair padded; 5 blocks
def test_blocked_bfloat16_matches_f_linear(rows, n, k):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert block_weight(w).shape == (n // 16, (k + 1) // 2, 16, 2)
    torch.testing.assert_close(blocked_linear_reference(x, block_weight(w)), F.linear(x, w), rtol=2e-2, atol=2e-2)
    out = blocked_linear(x, block_weight(w))
    assert out.dtype == torch.bfloat16
    # float32 accumulation, one rounding to bf16 at the end: within bf16's half-ulp of the exact product
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), exact, rtol=4e-3, atol=1e-3)


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 5, 16, 17, 40, 100])
# every tile width, odd K; and one with K in 3 slices and the columns in 2 chunks of widened
# blocks in the many-rows form (AVX2, from 64 rows: blocked_linear.cpp WIDENED_BYTES, KC)
@pytest.mark.parametrize("n,k", [(16, 64), (48, 37), (80, 128), (336, 40), (1056, 1300)])
def test_blocked_bfloat16_widened_matches_f_linear_and_the_register_form(rows, n, k):
    """widen=True: W's tiles widened to float32 once per call, float32 tiles. Against F.linear in
    float32 of the bf16 values (one rounding at the end); where the level has no bf16 dot
    product the register form runs the same FMAs in the same order: bitwise equal there."""
    g = torch.Generator().manual_seed(rows * 7 + n + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    wb = block_weight(w)
    out = blocked_linear(x, wb, widen=True)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), exact, rtol=4e-3, atol=1e-3)
    # the reference rounds its own float32 sums (another order) to bf16: one ulp apart at most
    torch.testing.assert_close(out, blocked_linear_reference(x, wb), rtol=8e-3, atol=1e-3)
    if not at_least("avx512_bf16"):
        assert torch.equal(out, blocked_linear(x, wb))
    with pytest.raises(ValueError, match="for bfloat16 weights"):
        blocked_linear(x.float(), block_weight(w.float()), widen=True)


@needs_native
@pytest.mark.parametrize("rows", [1, 15, 16, 64])
def test_widening_projection_widens_from_its_row_threshold(block_every_size, monkeypatch, rows):
    w = torch.randn(48, 64).bfloat16()
    # Chosen only where oneDNN does not pack bf16 and the level has no bf16 dot product (AVX2);
    # built directly at the other levels, whose kernels have the widened form too.
    chosen = not onednn_packs(torch.bfloat16) and not at_least("avx512_bf16")
    assert (type(choose_projection(w)) is WideningProjection) == chosen
    proj = WideningProjection(w)
    widened = []
    monkeypatch.setattr(projection_mod, "blocked_linear",
                        lambda x, wb, widen=False: widened.append(widen) or blocked_linear(x, wb, widen))
    x = torch.randn(rows, 64).bfloat16()
    torch.testing.assert_close(proj(x).float(), F.linear(x.float(), w.float()), rtol=4e-3, atol=1e-3)
    assert widened == [rows >= projection_mod.WIDEN_MIN_ROWS]
    assert proj.replaces_weight


@needs_native
def test_blocked_linear_keeps_leading_dims_and_checks_its_input():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(32, 24, generator=g)
    x = torch.randn(2, 3, 24, generator=g)
    torch.testing.assert_close(blocked_linear(x, block_weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"does not fit a blocked weight \(2, 24, 16\)"):
        blocked_linear(torch.randn(3, 25), block_weight(w))
    with pytest.raises(ValueError, match="multiple of 16"):
        block_weight(torch.randn(30, 24))


@needs_native
def test_blocked_linear_under_torch_compile():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(48, 40, generator=g)
    proj = BlockedProjection(w)
    f = torch.compile(lambda x: torch.relu(linear(x, proj)) * 2, dynamic=True)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(f(x), torch.relu(F.linear(x, w)) * 2, rtol=1e-5, atol=1e-5)
    wb16 = block_weight(w.bfloat16())      # the widened bf16 form goes through the graph op too
    f16 = torch.compile(lambda x: torch.relu(blocked_linear(x, wb16, widen=True)) * 2, dynamic=True)
    for rows in (1, 20):
        x = torch.randn(rows, 40, generator=g).bfloat16()
        torch.testing.assert_close(f16(x), torch.relu(blocked_linear(x, wb16, widen=True)) * 2, rtol=0, atol=0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_rows_are_the_weights_rows(dtype):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(48, 37, generator=g).to(dtype)
    ids = torch.tensor([0, 17, 47, 17, 5])
    proj = BlockedProjection(w)
    torch.testing.assert_close(proj.rows(ids), w[ids], rtol=0, atol=0)
    torch.testing.assert_close(blocked_mod.blocked_rows_reference(proj.blocked, ids, 37), w[ids], rtol=0, atol=0)
    assert proj.rows(ids[:0]).shape == (0, 37)
    traced = torch.compile(lambda i: proj.rows(i) * 2, dynamic=True)
    torch.testing.assert_close(traced(ids), w[ids] * 2, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"blocked_rows: an id of \[0, 48\] is outside the weight's 48 rows"):
        proj.rows(torch.tensor([0, 48]))
    with pytest.raises(ValueError, match="outside the weight's 48 rows"):
        proj.rows(torch.tensor([-1]))
    with pytest.raises(ValueError, match="ids must be int64"):
        proj.rows(ids.int())


# ---- the SwiGLU MLP in one call (blocked_linear.cpp blocked_mlp) ------------------------------

def _mlp_weights(dtype, hidden, inner, seed):
    g = torch.Generator().manual_seed(seed)
    return ((torch.randn(2 * inner, hidden, generator=g) * 0.1).to(dtype),
            (torch.randn(hidden, inner, generator=g) * 0.1).to(dtype), g)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden, inner", [(192, 384), (64, 40), (32, 24)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 63, 64, 80])
def test_fused_mlp_equals_its_three_calls_bitwise(dtype, hidden, inner, rows):
    """The fused op runs the same tiles over the same blocks and the same activation code as
    linear_blocked, silu_mul, linear_blocked: identical values at every row count, including
    those (64 on) where it makes the three calls itself."""
    w_gu, w_d, g = _mlp_weights(dtype, hidden, inner, rows * 100 + inner)
    gu, d = block_weight(w_gu), block_weight(w_d)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    fused = native_ops().mlp_blocked.default(x, gu, d)
    three = blocked_linear(native_ops().silu_mul.default(blocked_linear(x, gu)), d)
    assert fused.shape == (rows, hidden) and fused.dtype == dtype
    assert torch.equal(fused, three)
    # and what it computes: the MLP from F.linear in float32, rounded where the kernel rounds
    h = F.linear(x.float(), w_gu.float()).to(dtype)
    exact = F.linear(silu_mul_torch(h).float(), w_d.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), exact, rtol=tol, atol=tol)


@needs_native
def test_fused_mlp_does_not_depend_on_the_thread_count_and_checks_its_inputs():
    w_gu, w_d, g = _mlp_weights(torch.float32, 96, 200, 7)
    gu, d = block_weight(w_gu), block_weight(w_d)
    x = torch.randn(2, 3, 96, generator=g)                  # leading dims kept
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_ops().mlp_blocked.default(x, gu, d)
        torch.set_num_threads(2)
        two = native_ops().mlp_blocked.default(x, gu, d)
    finally:
        torch.set_num_threads(previous)
    assert one.shape == (2, 3, 96) and torch.equal(one, two)
    with pytest.raises(ValueError, match=r"blocked_mlp: x \(3, 95\) torch.float32 does not fit"):
        native_ops().mlp_blocked.default(torch.randn(3, 95), gu, d)
    with pytest.raises(ValueError, match="does not fit"):
        native_ops().mlp_blocked.default(x.bfloat16(), gu, d)            # dtypes differ
    with pytest.raises(ValueError, match="does not fit"):
        native_ops().mlp_blocked.default(x, gu, block_weight(torch.randn(96, 96)))   # down's K != I


def _fused_calls(x, gate_up: Linear, down: Linear):
    with recorded_calls("mlp_blocked") as calls:
        out = gate_up.method.apply_swiglu(gate_up, down, x, silu_mul)
    return out, len(calls)


def _three_calls(x, gate_up: Linear, down: Linear):
    return down(silu_mul(gate_up(x)))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 15, 16, 40])
def test_swiglu_fuses_where_both_projections_run_the_register_form(block_every_size, dtype, rows):
    """CpuLinearMethod.apply_swiglu: one mlp_blocked call where both weights are blocked and their
    own calls would take linear_blocked's register form at this row count (blocked; widening
    below WIDEN_MIN_ROWS; a few-rows split's copy up to FEW_ROWS), else the three calls, with the
    same values either way."""
    w_gu, w_d, g = _mlp_weights(dtype, 64, 48, rows)
    gu_layer, d_layer = loaded_layer(w_gu), loaded_layer(w_d)
    gu = gu_layer.layout
    x = torch.randn(rows, 64, generator=g).to(dtype)
    out, calls = _fused_calls(x, gu_layer, d_layer)
    three = _three_calls(x, gu_layer, d_layer)
    if isinstance(gu, FewRowsSplit):
        fuses = rows <= projection_mod.FEW_ROWS
    elif isinstance(gu, WideningProjection):
        fuses = rows < projection_mod.WIDEN_MIN_ROWS
    else:
        fuses = isinstance(gu, BlockedProjection)
    assert calls == int(fuses)
    if fuses or dtype == torch.float32:
        assert torch.equal(out, three)
    else:                                   # the three calls themselves (oneDNN or widened tiles)
        torch.testing.assert_close(out, three, rtol=0, atol=0)


@needs_native
def test_compiled_graphs_take_the_fused_mlp_and_the_native_gather(block_every_size):
    """A traced decode-sized MLP is one mlp_blocked call (no linear_blocked), and a blocked
    table's rows one blocked_rows call: inductor then has no gather to inline into its loops."""
    w_gu, w_d, g = _mlp_weights(torch.float32, 64, 48, 12)
    gu, d = loaded_layer(w_gu), loaded_layer(w_d)
    table = BlockedProjection(torch.randn(96, 64, generator=g))
    graphs = []

    def backend(gm, _inputs):
        graphs.append({node.target for node in gm.graph.nodes})
        return gm.forward
    torch._dynamo.reset()
    f = torch.compile(lambda ids: gu.method.apply_swiglu(gu, d, table.rows(ids), silu_mul), backend=backend,
                      dynamic=True)
    ids = torch.tensor([5, 90, 17])
    assert torch.equal(f(ids), _three_calls(table.rows(ids), gu, d))
    ops = torch.ops.hybrid_engine_cpu
    assert ops.mlp_blocked.default in graphs[0] and ops.blocked_rows.default in graphs[0]
    assert ops.linear_blocked.default not in graphs[0]


@needs_native
def test_swiglu_keeps_three_calls_where_a_weight_is_cropped_or_plain(block_every_size):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 40, generator=g)
    gate_up = loaded_layer(torch.randn(96, 40, generator=g))
    cropped_down = loaded_layer(torch.randn(40, 48, generator=g))           # 40 rows: padded to 48
    assert isinstance(cropped_down.layout, BlockedProjection) and cropped_down.layout.blocked.shape[0] == 3
    out, calls = _fused_calls(x, gate_up, cropped_down)
    assert calls == 0 and out.shape == (1, 40)
    assert torch.equal(out, _three_calls(x, gate_up, cropped_down))
    plain_down = loaded_layer(torch.randn(48, 48, generator=g), LinearMethod())
    out, calls = _fused_calls(x, gate_up, plain_down)
    assert calls == 0 and torch.equal(out, _three_calls(x, gate_up, plain_down))
    assert fused_swiglu(x.double(), gate_up.layout, choose_projection(torch.randn(48, 48, generator=g))) is None


# ---- preparing a model's projections (models/linear.py, models/qwen3_5.py) --------------------

@needs_native
def test_the_cpu_method_lays_out_float32_and_leaves_odd_shapes_plain(block_every_size):
    """After loading, a blockable weight runs from its blocked layout and its plain copy is
    freed; a weight the kernel cannot take keeps its plain weight. Both give F.linear."""
    a, b = torch.randn(32, 24), torch.randn(32, 24, dtype=torch.float64)    # float64: not blockable
    x = torch.randn(4, 24)
    la, lb = loaded_layer(a), loaded_layer(b)
    assert isinstance(la.layout, BlockedProjection) and la.weight.is_meta
    assert lb.layout is None and torch.equal(lb.weight, b)
    torch.testing.assert_close(la(x), F.linear(x, a), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lb(x.double()), F.linear(x.double(), b), rtol=1e-5, atol=1e-5)
    assert torch.equal(la.rows(torch.tensor([3, 0])), a[[3, 0]])


def test_merged_shards_load_into_their_rows():
    """A merged layer takes each checkpoint tensor into its own rows, in any order, and its
    output splits back into the products of the separate weights."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(6, 8, generator=g), torch.randn(2, 8, generator=g)
    with torch.device("meta"):
        layer = Linear(8, shards={"q_proj": 6, "k_proj": 2})
    assert layer.checkpoint_shapes("attn.qk_proj") == {"attn.q_proj.weight": (6, 8), "attn.k_proj.weight": (2, 8)}
    layer.weight_loader("attn.k_proj.weight", k)
    layer.weight_loader("attn.q_proj.weight", q)
    layer.process_weights_after_loading()
    x = torch.randn(3, 8, generator=g)
    got_q, got_k = layer(x).split(layer.output_sizes, dim=-1)
    torch.testing.assert_close(got_q, F.linear(x, q))
    torch.testing.assert_close(got_k, F.linear(x, k))
    with pytest.raises(ValueError, match="either out_features or shards"):
        Linear(8, 4, shards={"q_proj": 4})


def test_without_the_native_kernel_float32_weights_stay_plain(monkeypatch):
    monkeypatch.setattr(blocked_mod, "native_ops", lambda: None)
    assert not native_available() and isinstance(choose_projection(torch.randn(1024, 1024)), PlainProjection)


@needs_native
def test_small_float32_weights_are_blocked_too():
    # also where MKL's GEMV is tuned (Intel): the MLP of two blocked weights is one native call,
    # and MTP verify's rows run faster in the kernel (kernels/linear/cpu.py)
    assert isinstance(choose_projection(torch.randn(256, 1024)), BlockedProjection)
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(240, 1024, generator=g), torch.randn(3, 1024, generator=g)
    small = choose_projection(w)
    assert isinstance(small, BlockedProjection)
    torch.testing.assert_close(small(x), F.linear(x, w), rtol=1e-5, atol=1e-4)
    # and small bf16 weights, up to 16 rows where oneDNN packs bf16
    # (test_small_bf16_weights_run_the_kernel_up_to_16_rows)
    small_bf16 = choose_projection(torch.randn(240, 1024).bfloat16())
    assert isinstance(small_bf16, FewRowsSplit if onednn_packs(torch.bfloat16) else BlockedProjection)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_lm_head_embeds_and_projects_the_same(block_every_size, tmp_path, tied, dtype):
    """Where lm_head's method holds the weights in its own layout the plain weight is freed (no
    second copy) and a tied embedding reads its rows from lm_head: the same embeddings and
    logits as the plain method's model."""
    from checkpoints import make_hf_model, save_checkpoint

    from hybrid_engine.models import load_model
    folder = save_checkpoint(make_hf_model("qwen3_5", tie_word_embeddings=tied), tmp_path)
    plain, cfg = load_model(folder, str(dtype).removeprefix("torch."), method=LinearMethod())
    model, _ = load_model(folder, str(dtype).removeprefix("torch."), method=CpuLinearMethod())
    ids = torch.tensor([0, 5, 17, cfg.vocab_size - 1, 5])
    hidden = torch.randn(3, cfg.hidden_size).to(dtype)
    want_embeds, want_logits = plain.embed(ids), plain.compute_logits(hidden).float()
    if native_available():
        assert model.lm_head.layout is not None
        assert model.lm_head.weight.is_meta
        assert model.embed_tokens.weight.is_meta == (tied and model.lm_head.layout.replaces_weight)
    torch.testing.assert_close(model.embed(ids), want_embeds, rtol=0, atol=0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(model.compute_logits(hidden).float(), want_logits, rtol=tol, atol=tol)


@needs_native
@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 4, 5, 16])
def test_packed_bf16_weight_takes_its_blocked_copy_for_few_rows(block_every_size, monkeypatch, rows):
    w = torch.randn(64, 48).t().contiguous().bfloat16() * 0.1
    x = torch.randn(rows, 64).bfloat16()
    exact = F.linear(x.float(), w.float())
    proj = loaded_layer(w).layout
    assert isinstance(proj, FewRowsSplit) and isinstance(proj.many, OneDNNProjection)
    assert proj.few.blocked.shape == (3, 32, 16, 2)
    calls = []
    monkeypatch.setattr(projection_mod, "blocked_linear", lambda *a: calls.append(1) or blocked_linear(*a))
    torch.testing.assert_close(linear(x, proj).float(), exact, rtol=2e-2, atol=2e-2)
    assert calls == ([1] if rows <= projection_mod.FEW_ROWS else [])


@needs_native
@needs_onednn_bf16
def test_engine_keeps_the_bf16_few_rows_copy_only_when_asked():
    from hybrid_engine import LLM, SamplingParams
    from hybrid_engine.config import EngineConfig
    outs = {}
    for keep in (True, False):
        llm = LLM(dtype="bfloat16", max_num_seqs=2, bf16_few_rows_copy=keep)
        assert isinstance(llm.engine.model.lm_head.layout, FewRowsSplit) == keep
        outs[keep] = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert all(len(o.token_ids) == 4 for o in outs.values())
    with pytest.raises(ValueError, match="bf16_few_rows_copy must be a bool"):
        EngineConfig(bf16_few_rows_copy="yes").validate()


@needs_native
@needs_onednn_bf16
def test_compiled_graphs_take_the_few_rows_copy_by_the_inputs_shape(block_every_size):
    """Compiled steps leave bf16 weights plain (inductor packs its own) with their blocked copy.
    The row count is read from the traced input's shape, so dynamo guards on it: a graph traced
    for at most FEW_ROWS rows calls the blocked op, one traced for more the plain product, and
    each serves its range (two graphs, no flag). Both compute x W^T."""
    w = torch.randn(48, 64).bfloat16()
    proj = choose_projection(w, onednn=False)
    assert isinstance(proj, FewRowsSplit) and isinstance(proj.many, PlainProjection)
    graphs = []

    def backend(gm, _inputs):
        graphs.append({node.target for node in gm.graph.nodes})
        return gm.forward
    import torch.fx.experimental._config as fx_config
    torch._dynamo.reset()
    f = torch.compile(lambda x: linear(x, proj), backend=backend)
    blocked_op = torch.ops.hybrid_engine_cpu.linear_blocked.default
    with fx_config.patch(backed_size_oblivious=True):     # as compiled steps trace: no 1-row graph
        for rows, graph in ((1, 0), (3, 0), (5, 1), (16, 1), (4, 0), (2, 0), (9, 1)):
            x = torch.randn(rows, 64).bfloat16()
            torch._dynamo.maybe_mark_dynamic(x, 0)
            torch.testing.assert_close(f(x).float(), F.linear(x.float(), w.float()), rtol=2e-2, atol=2e-2)
            assert (blocked_op in graphs[graph]) == (graph == 0)
    assert len(graphs) == 2


# ---- the engine at this level ------------------------------------------------------------------

def _generate(folder, dtype, prompts, new):
    from hybrid_engine import LLM, SamplingParams
    llm = LLM(model=str(folder), dtype=dtype, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True, logprobs=0)
    return llm, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_every_projection_prepared_matches_its_reference(tmp_path, block_every_size, monkeypatch, dtype):
    """Every blockable projection in its level's layout (none stays plain for being small).
    float32: greedy tokens and logprobs as transformers' float32 gives them. bfloat16 (whose
    rounding alone moves logprobs by tenths against float32): the same tokens as the engine's own
    plain path, every projection on F.linear, and logprobs within a quarter of that path's own
    distance from float32."""
    from checkpoints import make_hf_model, save_checkpoint

    hf = make_hf_model("qwen3_5", full_attention_interval=2)
    save_checkpoint(hf, tmp_path)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (1, 9, 40)]
    new = 24
    llm, outs = _generate(tmp_path, dtype, prompts, new)
    want = expected_layout(getattr(torch, dtype), True, True)
    layouts = {type(getattr(m, "layout", None)) for m in llm.engine.model.modules() if isinstance(m, Linear)}
    assert layouts == ({type(None)} if want is PlainProjection else {want})
    if dtype == "bfloat16":
        # the same engine with every projection's plain weight (F.linear)
        monkeypatch.setattr(CpuBackend, "linear_method", lambda self, **kw: LinearMethod())
        _, refs = _generate(tmp_path, dtype, prompts, new)
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        ours = torch.tensor([lp[t] for lp, t in zip(out.logprobs, out.token_ids)])
        if dtype == "float32":
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
            assert out.token_ids == ref.argmax(-1).tolist()
            ref_logp = torch.log_softmax(ref, dim=-1)[torch.arange(new), torch.tensor(out.token_ids)]
            assert (ours - ref_logp).abs().max() < 1e-4
        else:
            assert out.token_ids == refs[i].token_ids
            theirs = torch.tensor([lp[t] for lp, t in zip(refs[i].logprobs, refs[i].token_ids)])
            # Two bf16 paths differ only in rounding order, and by how much depends on the CPU's own
            # bf16 F.linear (oneDNN picks its kernel per CPU): a fixed bound held here and failed on
            # another CI machine at 0.053. The scale is bf16's error itself, the plain path's distance
            # from float32; a wrong layout misses by whole units, not by a fraction of that.
            with torch.no_grad():
                ref = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:].float()
            ref_logp = torch.log_softmax(ref, dim=-1)[torch.arange(new), torch.tensor(out.token_ids)]
            bf16_error = (theirs - ref_logp).abs().max()
            assert (ours - theirs).abs().max() <= 0.25 * bf16_error, (ours - theirs).abs().max()


@needs_native
def test_graph_ops_have_no_default_arguments():
    """Inductor's C++ wrapper leaves out an argument equal to its schema default and hands the
    dispatcher a shorter stack (torch 2.13): the op then reads that argument from past it. So
    no graph op may declare defaults (linear_blocked's `widen` read True from garbage)."""
    native_ops()                                   # loads the library: registers the ops
    names = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("hybrid_engine_cpu::")]
    assert "hybrid_engine_cpu::linear_blocked" in names
    for name in names:
        schema = torch._C._get_schema(name, "")
        assert not [a.name for a in schema.arguments if a.has_default_value()], schema
