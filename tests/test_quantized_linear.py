"""kernels/linear/quantized.py and quant_linear.cpp: the int8 / int4 group quantization, its packed
layout, the native product against its torch reference (symmetric, and with zero points at
every level this process may run), and the linear method that holds a layer's weights
quantized (run with HYBRID_ENGINE_CPU_ISA=avx512 and =avx2 too: the kernel's forms without
VNNI and at the other width)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hybrid_engine.kernels.linear.quantized import (INT4_DIVISORS, RESCORED_ROWS, QuantizedLinearMethod, QuantizedWeight,
                                                    _int4_search_torch, block_bytes, dequantize, pack, pack_zeros,
                                                    packed_scales, quant_linear, quant_linear_reference, quantize,
                                                    quantize_packed, rescore_top_reference, unpack)
from hybrid_engine.kernels.native.isa import LEVELS, at_least
from hybrid_engine.kernels.native.ops import native_ops
from hybrid_engine.models.linear import Linear

needs_native = pytest.mark.skipif(not at_least("avx2") or native_ops() is None, reason="level none: no native kernel")
NATIVE_LEVELS = [lvl for lvl in LEVELS[1:] if at_least(lvl)]   # the levels this process may run
# Tests of the native ops at each level: at level none (a CPU without AVX2, or the override) no
# op is built to test; the torch references those ops match are tested there by the others.
needs_native_levels = pytest.mark.skipif(not NATIVE_LEVELS, reason="level none: no native kernel")
CODES = {8: (-128, 127), 4: (-8, 7)}                          # values and zero points: the codes less their middle


def asymmetric_weight(n: int, k: int, bits: int, group: int, seed: int) -> QuantizedWeight:
    """Random codes and zero points over the whole range (q - z reaches +-255 at int8)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = CODES[bits]
    values = torch.randint(lo, hi + 1, (n, k), generator=g, dtype=torch.int8)
    zeros = torch.randint(lo, hi + 1, (n, k // group), generator=g, dtype=torch.int8)
    return QuantizedWeight(values, (torch.rand(n, k // group, generator=g) / 100).half(), bits, group, zeros=zeros)


def test_int8_follows_the_q8_0_rule():
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0, 0.1, -0.3, 0.7, 0.2]])
    qw = quantize(w, 8, 4)
    assert torch.equal(qw.scales.float(), (torch.tensor([1.0, 0.7]) / 127).half().float()[None])
    assert qw.values[0, 1] == -127 and qw.values[0, 6] == 127
    # every value is within half a step of its scale
    err = (dequantize(qw) - w).abs().reshape(2, 4)
    assert (err <= qw.scales.float().reshape(2, 1).abs() / 2 + 1e-6).all()


def _group_errors(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Squared error of each group of w [N, K] at the given int4 scales [N, G] (float16)."""
    g = w.reshape(*scales.shape, -1)
    s = scales.float()[..., None]
    inverse = torch.where(s != 0, 1 / s, torch.zeros_like(s))
    return (g.double() - (torch.round(g * inverse).clamp(-8, 7) * s).double()).square().sum(-1)


@pytest.mark.parametrize("group", [8, 32])
def test_int4_scale_is_the_best_of_its_candidates(group):
    """Each group's int4 scale is, among max / d for the 21 divisors d around -8 (llama.cpp's
    Q4_0 rule at d = -8), the one of least squared error: never worse than Q4_0's, better on
    most groups of Gaussian weights."""
    g = torch.Generator().manual_seed(group)
    w = torch.randn(64, 4 * group, generator=g) * torch.rand(64, 1, generator=g)
    qw = quantize(w, 4, group)
    groups = w.reshape(64, 4, group)
    extreme = groups.gather(-1, groups.abs().argmax(-1, keepdim=True)).squeeze(-1)
    candidates = torch.stack([_group_errors(w, (extreme / d).half()) for d in INT4_DIVISORS])
    chosen = _group_errors(w, qw.scales)
    assert torch.equal(chosen, candidates.min(0).values)
    q4_0 = candidates[INT4_DIVISORS.index(-8.0)]
    assert (chosen <= q4_0).all() and (chosen < q4_0).float().mean() > 0.5
    assert chosen.sum() < 0.95 * q4_0.sum()
    # the codes are those of the chosen scales, within half a step of each value or clamped
    assert torch.equal(qw.values.reshape(64, 4, group).float(),
                       torch.round(groups / qw.scales.float()[..., None]).clamp(-8, 7))


@needs_native
@settings(max_examples=30, deadline=None)
@given(group=st.sampled_from([8, 32, 128]), rows=st.integers(1, 24), groups=st.integers(1, 3),
       seed=st.integers(0, 2**16), zeros=st.booleans())
def test_native_int4_search_is_the_torch_one(group, rows, groups, seed, zeros):
    """quantize_int4.cpp chooses what `_int4_search_torch` chooses (all-zero groups included)."""
    w = torch.randn(rows, group * groups, generator=torch.Generator().manual_seed(seed))
    if zeros:
        w[0, :group] = 0
    codes, scales = native_ops().quantize_int4.default(w, group)
    want_codes, want_scales = _int4_search_torch(w, group)
    assert torch.equal(scales, want_scales) and torch.equal(codes, want_codes)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([8, 16, 32]), rows=st.integers(1, 40),
       groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_pack_and_unpack_round_trip(bits, group, rows, groups, seed):
    w = torch.randn(rows, group * groups, generator=torch.Generator().manual_seed(seed))
    qw = quantize(w, bits, group)
    assert int(qw.values.min()) >= (-127 if bits == 8 else -8) and int(qw.values.max()) <= (127 if bits == 8 else 7)
    q = pack(qw)
    assert q.shape == (-(-rows // 16), block_bytes(group * groups, bits, group)) and q.dtype == torch.uint8
    assert q.shape[1] == (groups + 1) // 2 * 64 + groups * group * 16 * bits // 8
    full = unpack(q, bits, group)
    assert torch.equal(full[:rows], dequantize(qw)) and not full[rows:].any()
    assert torch.equal(packed_scales(q, bits, group)[:rows], qw.scales)
    ids = torch.randint(0, rows, (5,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack(q, bits, group, rows=ids), dequantize(qw)[ids])


def test_packed_units_hold_two_groups_scales_then_their_codes():
    """The stream of a block of 16 rows: per unit of two groups, their float16 scales [2, 16]
    (64 bytes), then the groups' codes; an odd last group a unit of its own."""
    values = torch.arange(16 * 96).reshape(16, 96).remainder(15).sub(7).to(torch.int8)     # three groups of 32
    scales = (torch.arange(16 * 3).reshape(16, 3) + 1).half()
    q = pack(QuantizedWeight(values, scales, 4, 32))
    code_bytes = 32 * 16 // 2
    assert q.shape == (1, 64 + 2 * code_bytes + 64 + code_bytes)
    unit = 64 + 2 * code_bytes
    assert torch.equal(q[0, :64].view(torch.float16), scales[:, :2].t().reshape(-1))
    assert torch.equal(q[0, unit:unit + 32].view(torch.float16), scales[:, 2])
    assert not q[0, unit + 32:unit + 64].any()                       # the odd unit's unused half
    # the first lane of the second group: row 0's k = 32..35 (low nibbles) and 36..39 (high), each + 8
    low, high = (values[0, 32:36] + 8).tolist(), (values[0, 36:40] + 8).tolist()
    assert q[0, 64 + code_bytes:64 + code_bytes + 4].tolist() == [lo | hi << 4 for lo, hi in zip(low, high)]


def test_dequantize_takes_the_zero_points_off():
    qw = QuantizedWeight(torch.tensor([[-128, 127, 0, 5, 1, 2, 3, 4]], dtype=torch.int8),
                         torch.tensor([[0.5, 2.0]]).half(), 8, 4, zeros=torch.tensor([[127, -128]], dtype=torch.int8))
    want = [[-127.5, 0.0, -63.5, -61.0, 258.0, 260.0, 262.0, 264.0]]
    assert dequantize(qw).tolist() == want
    q = pack(qw)
    assert unpack(q, 8, 4, zeros=pack_zeros(qw))[:1].tolist() == want
    assert q[0, 64:68].tolist() == [0, 255, 128, 133]        # the stored byte: the code q itself


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([8, 4]), group=st.sampled_from([8, 16, 32]), rows=st.integers(1, 40),
       groups=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_pack_and_unpack_round_trip_with_zero_points(bits, group, rows, groups, seed):
    qw = asymmetric_weight(rows, group * groups, bits, group, seed)
    q = pack(qw)
    zeros = pack_zeros(qw)
    assert zeros.dtype == torch.int8 and zeros.shape == (-(-rows // 16), groups, 16)
    full = unpack(q, bits, group, zeros=zeros)
    assert torch.equal(full[:rows], dequantize(qw)) and not full[rows:].any()
    zero_at, scale_at = (t.float().repeat_interleave(group, 1) for t in (qw.zeros, qw.scales))
    want = (qw.values.float() - zero_at) * scale_at
    assert torch.equal(dequantize(qw), want)
    ids = torch.randint(0, rows, (5,), generator=torch.Generator().manual_seed(seed))
    assert torch.equal(unpack(q, bits, group, rows=ids, zeros=zeros), want[ids])


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", [32, 128])
def test_native_product_with_zero_points_against_the_reference(level, bits, group):
    """Zero points over their whole range at each level's form (VNNI, and the maddubs forms
    without it): the kernel's bits are the reference's at 1 to 5 rows, float32 and bf16."""
    product = native_ops(level).linear_quant.default
    qw = asymmetric_weight(40, 256, bits, group, seed=bits * group)
    q = pack(qw)
    zeros = pack_zeros(qw)
    g = torch.Generator().manual_seed(group)
    for dtype in (torch.float32, torch.bfloat16):
        for m in range(1, 6):
            x = torch.randn(m, 256, generator=g).to(dtype)
            got = product(x, q, zeros, bits, group)
            assert got.dtype == dtype and got.shape == (m, 48)
            assert torch.equal(got, quant_linear_reference(x, q, bits, group, True, zeros)), (dtype, m)
    # the zero points matter: without them the product is another one
    x = torch.randn(2, 256, generator=g)
    assert not torch.equal(product(x, q, zeros, bits, group), product(x, q, None, bits, group))
    exact = x @ dequantize(qw).t()
    got = product(x, q, zeros, bits, group)[:, :40]
    assert ((got - exact).abs().max() / exact.abs().max()).item() < 0.02


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
def test_native_product_refuses_zero_points_that_do_not_fit(level):
    product = native_ops(level).linear_quant.default
    qw = asymmetric_weight(16, 64, 4, 32, seed=0)
    q = pack(qw)
    with pytest.raises(ValueError, match=r"zeros .* are not int8 \[1, 2, 16\]"):
        product(torch.randn(1, 64), q, pack_zeros(qw).float(), 4, 32)
    with pytest.raises(ValueError, match=r"zeros .* are not int8 \[1, 2, 16\]"):
        product(torch.randn(1, 64), q, pack_zeros(qw)[:, :1].contiguous(), 4, 32)


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([8, 4]), rows=st.integers(1, 80), slices=st.sampled_from([16, 32, 48]),
       seed=st.integers(0, 2**16))
def test_quantize_packed_in_slices_is_pack_of_quantize(bits, rows, slices, seed):
    """Loading quantizes a float weight a slice of rows at a time (the last one padded): the same bits."""
    w = torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)).bfloat16()
    assert torch.equal(quantize_packed(w, bits, 32, rows_at_once=slices), pack(quantize(w, bits, 32)))


@needs_native
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group, k", [(32, 512), (128, 512), (32, 480), (128, 640)])   # the last two: odd groups
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_product_against_the_reference(bits, group, k, dtype):
    """The kernel rounds x to int8 in blocks of 32 and sums integers: the reference takes the same
    steps in torch, and gives the same bits at every row count; each row's result is the same
    whichever rows it is computed with (a decode's row alone or in a batch)."""
    g = torch.Generator().manual_seed(bits * group)
    n = 100
    qw = quantize(torch.randn(n, k, generator=g), bits, group)
    q = pack(qw)
    x_all = torch.randn(33, k, generator=g).to(dtype)
    alone = torch.cat([quant_linear(x_all[i:i + 1], q, bits, group) for i in range(33)])
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 16, 33):
        x = x_all[:m]
        got = quant_linear(x, q, bits, group)
        assert got.dtype == dtype and got.shape == (m, 112)
        assert torch.equal(got, alone[:m]), m
        assert torch.equal(got, quant_linear_reference(x, q, bits, group, int8_activations=True)), m
    # and x's rounding is what separates it from the float product: within a few 1/254 of max|x|
    exact = quant_linear_reference(x_all, q, bits, group).float()
    assert ((alone.float() - exact).abs().max() / exact.abs().max()).item() < 0.02


@needs_native
def test_native_product_refuses_what_does_not_fit():
    qw = quantize(torch.randn(16, 64), 4, 32)
    q = pack(qw)
    with pytest.raises(ValueError, match="group 16 is not a multiple of 32"):
        quant_linear(torch.randn(1, 64), q, 4, 16)
    with pytest.raises(ValueError, match="does not fit int4 weights"):
        quant_linear(torch.randn(1, 32), q, 4, 32)
    with pytest.raises(ValueError, match="does not fit int8 weights"):
        quant_linear(torch.randn(1, 64), q, 8, 32)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quant_linear(torch.randn(1, 64), q, 2, 32)
    with pytest.raises(ValueError, match="takes groups of a multiple of 32"):
        QuantizedLinearMethod(8, 16, native=True)


def test_quantize_refuses_a_group_that_does_not_divide():
    with pytest.raises(ValueError, match="group size 32 does not divide the 48 input columns"):
        quantize(torch.randn(4, 48), 8, 32)
    with pytest.raises(ValueError, match="even int"):
        quantize(torch.randn(4, 48), 4, 3)


def _layer(weight, method, shards=None):
    with torch.device("meta"):
        layer = (Linear(weight.shape[1], shards=shards, method=method) if shards
                 else Linear(weight.shape[1], weight.shape[0], method=method))
    if shards:
        start = 0
        for name, rows in shards.items():
            layer.weight_loader(f"p.{name}.weight", weight[start:start + rows])
            start += rows
    else:
        layer.weight_loader("p.weight", weight)
    layer.process_weights_after_loading()
    return layer


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
@pytest.mark.parametrize("bits", [8, 4])
def test_method_keeps_float_shards_float(native, bits):
    g = torch.Generator().manual_seed(1)
    shards = {"in_proj_qkv": 40, "in_proj_z": 24, "in_proj_b": 4, "in_proj_a": 4}
    w = torch.randn(72, 64, generator=g)
    layer = _layer(w, QuantizedLinearMethod(bits, 32, native=native, float_shards=("in_proj_b", "in_proj_a")), shards)
    assert layer.weight.is_meta and layer.float_tail.shape == (8, 64)
    x = torch.randn(3, 64, generator=g)
    q = pack(quantize(w[:64], bits, 32))
    quantized = (quant_linear_reference(x, q, bits, 32, int8_activations=True) if native
                 else x @ dequantize(quantize(w[:64], bits, 32)).t())            # the native kernel rounds x
    want = torch.cat([quantized, x @ w[64:].t()], dim=-1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    # the float rows are the loaded ones, exactly
    assert torch.equal(layer(x)[:, 64:], x @ w[64:].t())


@needs_native
def test_cpu_float_tail_is_blocked_and_row_invariant():
    """The cpu backend runs a bf16 float tail (a few KB: oneDNN's size) in the blocked kernel,
    and a row's tail values are the same bits whether it is alone or in a batch of 5 (MTP
    verify's rows against decode's one)."""
    from hybrid_engine.kernels.linear.cpu import BlockedProjection, CpuLinearMethod, WideningProjection
    g = torch.Generator().manual_seed(2)
    shards = {"in_proj_qkv": 64, "in_proj_z": 32, "in_proj_b": 16, "in_proj_a": 16}
    w = torch.randn(128, 64, generator=g).bfloat16()
    method = QuantizedLinearMethod(4, 32, native=True, float_shards=("in_proj_b", "in_proj_a"),
                                   float_method=CpuLinearMethod())
    layer = _layer(w, method, shards)
    assert isinstance(layer.tail_product, (BlockedProjection, WideningProjection))
    x = torch.randn(5, 64, generator=g).bfloat16()
    together = layer(x)[:, 96:]
    for i in range(5):
        assert torch.equal(layer(x[i:i + 1])[0, 96:], together[i])
    torch.testing.assert_close(together.float(), x.float() @ w[96:].float().t(), rtol=2e-2, atol=2e-2)


def _counting(op, calls: list):
    """A stand-in for the op packet `op` whose `.default` appends to `calls`, then runs op's."""
    return type("Op", (), {"default": staticmethod(lambda *args: calls.append(1) or op.default(*args))})


@needs_native
@pytest.mark.parametrize("tail_rows", [8, 32])                   # 8: a tail padded to a block and cropped
def test_cpu_float_tail_runs_in_the_products_call(tail_rows):
    """A quantized layer with a blocked float tail (the GDN in_proj) runs as one linear_quant_tail
    call: the same bits as the method's apply (the quantized product, the tail's, a cat) at decode's
    and prefill's row counts (16 and more: the widened form where the level has no bf16 dot)."""
    from hybrid_engine.kernels.linear.cpu import CpuLinearMethod
    g = torch.Generator().manual_seed(5)
    shards = {"in_proj_qkv": 64, "in_proj_z": 32, "in_proj_b": tail_rows // 2, "in_proj_a": tail_rows // 2}
    w = torch.randn(96 + tail_rows, 64, generator=g).bfloat16()
    method = QuantizedLinearMethod(4, 32, native=True, float_shards=("in_proj_b", "in_proj_a"),
                                   float_method=CpuLinearMethod())
    layer = _layer(w, method, shards)
    calls = []
    with mock.patch.object(torch.ops.hybrid_engine_cpu, "linear_quant_tail",
                           _counting(torch.ops.hybrid_engine_cpu.linear_quant_tail, calls)):
        layer._bind(method.product(layer))
        for rows in (1, 3, 16, 40):
            x = torch.randn(rows, 64, generator=g).bfloat16()
            got = layer(x)
            assert got.shape == (rows, 96 + tail_rows) and got.is_contiguous()
            assert torch.equal(got, method.apply(layer, x)), rows
    assert len(calls) == 4


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
def test_native_tail_product_is_the_two_products(level):
    from hybrid_engine.kernels.linear.blocked import block_weight
    ops = native_ops(level)
    g = torch.Generator().manual_seed(6)
    q = pack(quantize(torch.randn(48, 64, generator=g), 8, 32))
    tail = block_weight(torch.randn(16, 64, generator=g).bfloat16())
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        for widen in (False, True):
            want = torch.cat([ops.linear_quant(x, q, None, 8, 32), ops.linear_blocked(x, tail, widen)[:, :12]], -1)
            assert torch.equal(ops.linear_quant_tail(x, q, None, 8, 32, tail, widen, 12), want)
    with pytest.raises(ValueError, match=r"linear_quant_tail: 17 rows of a blocked tail \(1, 32, 16, 2\) of 16"):
        ops.linear_quant_tail(x, q, None, 8, 32, tail, False, 17)


def test_method_refuses_float_shards_that_are_not_the_last():
    method = QuantizedLinearMethod(8, 32, float_shards=("in_proj_qkv",))
    with pytest.raises(ValueError, match="not the last"):
        _layer(torch.randn(72, 64), method, {"in_proj_qkv": 40, "in_proj_z": 24, "in_proj_b": 4, "in_proj_a": 4})


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
@pytest.mark.parametrize("bits", [8, 4])
def test_method_runs_asymmetric_weights(native, bits):
    """A format's zero points held beside the scales: the layer's product is the reference's,
    its rows the dequantized ones."""
    qw = asymmetric_weight(40, 128, bits, 32, seed=bits)
    layer = _layer(torch.zeros(40, 128), QuantizedLinearMethod(bits, 32, native=native))
    layer.method.load_quantized(layer, qw, None, torch.float32)
    assert torch.equal(layer.qzeros, pack_zeros(qw))
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    q = pack(qw)
    want = quant_linear_reference(x, q, bits, 32, native, pack_zeros(qw))[:, :40]
    assert torch.equal(layer(x), want)
    assert torch.equal(layer.rows(torch.tensor([0, 39, 7])), dequantize(qw)[[0, 39, 7]])


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
def test_method_takes_symmetric_int8_of_minus_128(native):
    """Symmetric int8 formats may store -128 (compressed-tensors' and GPTQ's int8 codes reach
    it): the forms without VNNI cannot negate it, so such weights run with zero points 0."""
    qw = quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(3)), 8, 32)
    qw = qw._replace(values=qw.values.clone().index_fill_(1, torch.tensor([0, 5, 40]), -128))
    layer = _layer(torch.zeros(32, 64), QuantizedLinearMethod(8, 32, native=native))
    layer.method.load_quantized(layer, qw, None, torch.float32)
    assert layer.qzeros is not None and not layer.qzeros.any()
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    q = pack(qw)
    assert torch.equal(layer(x), quant_linear_reference(x, q, 8, 32, int8_activations=native))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_method_rows_are_the_dequantized_rows(dtype):
    w = torch.randn(40, 64)
    layer = _layer(w.to(dtype), QuantizedLinearMethod(4, 32))
    ids = torch.tensor([0, 39, 7])
    rows = layer.rows(ids)
    assert rows.dtype == dtype
    assert torch.equal(rows, dequantize(quantize(w.to(dtype), 4, 32))[ids].to(dtype))
    assert layer.method.holds_weight_elsewhere(layer)


@pytest.mark.parametrize("serves_rows", [True, False])
def test_rows_come_from_a_table_of_their_own_bits_where_the_layer_serves_lookups(serves_rows):
    """rows_bits: a layer that serves an embedding's lookups (a tied lm_head) keeps them at those
    bits beside its product's table; one that does not keeps no second table."""
    w = torch.randn(40, 64)
    with torch.device("meta"):
        layer = Linear(64, 40, method=QuantizedLinearMethod(4, 32, rows_bits=8))
    layer.serves_rows = serves_rows
    layer.weight_loader("p.weight", w)
    layer.process_weights_after_loading()
    ids = torch.tensor([0, 39, 7])
    x = torch.randn(3, 64)
    q = pack(quantize(w, 4, 32))
    product = quant_linear_reference(x, q, 4, 32)[:, :40]                       # the product: int4
    if serves_rows:           # and its 8 largest outputs a row scored again from the int8 rows
        top = product.topk(RESCORED_ROWS, dim=-1).indices
        int8_rows = dequantize(quantize(w, 8, 32))
        want = product.scatter(-1, top, (x.double()[:, None, :] * int8_rows[top].double()).sum(-1).float())
    else:
        want = product
    assert torch.equal(layer(x), want)
    assert (layer.row_table is not None) == serves_rows
    assert torch.equal(layer.rows(ids), dequantize(quantize(w, 8 if serves_rows else 4, 32))[ids])


@needs_native
def test_rescored_outputs_are_the_same_bits_in_any_batch():
    """MTP's lossless verify needs each row's logits alone and in a batch to be equal: the
    rescoring (a tied lm_head's int4 product, its top outputs scored again from the int8 rows)
    keeps that, and each rescored output is the int8 row's dot product with x."""
    w = torch.randn(200, 128, generator=torch.Generator().manual_seed(5))
    with torch.device("meta"):
        layer = Linear(128, 200, method=QuantizedLinearMethod(4, 32, native=True, rows_bits=8))
    layer.serves_rows = True
    layer.weight_loader("p.weight", w)
    layer.process_weights_after_loading()
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(6)).bfloat16()
    batch = layer(x)
    assert batch.shape == (9, 200) and batch.is_contiguous()            # (200 rows: cropped from 208)
    assert torch.equal(batch, torch.cat([layer(x[i:i + 1]) for i in range(9)]))
    int4 = quant_linear(x, pack(quantize(w, 4, 32)), 4, 32)[:, :200]
    changed = batch != int4
    assert 0 < int(changed.sum(-1).max()) <= RESCORED_ROWS
    exact = (x.float() @ dequantize(quantize(w, 8, 32)).t()).bfloat16()
    top = int4.topk(RESCORED_ROWS, dim=-1).indices
    assert torch.allclose(batch.gather(-1, top).float(), exact.gather(-1, top).float(), rtol=1e-2, atol=1e-2)


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("zeros", [False, True])
def test_native_rows_are_the_unpacked_rows(level, bits, zeros):
    """quant_rows reads an id's bytes from its block: the same values as unpack's whole-block split."""
    qw = asymmetric_weight(48, 96, bits, 32, seed=bits) if zeros else quantize(torch.randn(48, 96), bits, 32)
    packed, packed_zeros = pack(qw), pack_zeros(qw)
    ids = torch.tensor([0, 47, 16, 15, 33, 33])
    rows = native_ops(level).quant_rows.default(packed, packed_zeros, ids, bits, 32, 96)
    assert torch.equal(rows, unpack(packed, bits, 32, rows=ids, zeros=packed_zeros))
    assert torch.equal(rows, dequantize(qw)[ids])
    with pytest.raises(ValueError, match="outside the weight's 48 rows"):
        native_ops(level).quant_rows.default(packed, packed_zeros, torch.tensor([3, 48]), bits, 32, 96)
    with pytest.raises(ValueError, match="is not int"):
        native_ops(level).quant_rows.default(packed, packed_zeros, ids, bits, 32, 64)


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 17])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_rescoring_against_the_reference(level, dtype, rows, threads):
    """rescore_top (one pass over each row, split between threads where rows are few) replaces
    the same outputs as a topk with the int8 rows' dot products (products exact, summed in
    float64): the same bits. Distinct outputs: among equal ones the reference's topk may pick
    others."""
    g = torch.Generator().manual_seed(rows * 10 + threads)
    n, k = 1000, 128
    packed = quantize_packed(torch.randn(1008, k, generator=g), 8, 32)
    x = torch.randn(rows, k, generator=g).to(dtype)
    y = torch.randperm(rows * n, generator=g).reshape(rows, n).float().div(97).to(dtype)   # distinct values
    if dtype == torch.bfloat16:
        y = torch.arange(n).float().mul(0.01).sub(5).bfloat16().float().unique()[:n].expand(rows, -1)
        y = torch.stack([r[torch.randperm(r.shape[0], generator=g)] for r in y]).to(dtype)
        n = y.shape[1]
    want = rescore_top_reference(x, y, packed, 8, 32, RESCORED_ROWS)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = y.clone()
        native_ops(level).rescore_top.default(x, got, packed, None, 8, 32, RESCORED_ROWS)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert int((got != y).sum(-1).max()) <= RESCORED_ROWS


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
def test_native_rescoring_breaks_ties_by_id_and_skips_nan(level):
    """Equal outputs are taken in the order of their ids (whatever the split between threads),
    NaN never, and a row of fewer outputs than `count` is rescored whole. Each rescored output
    is x . the int8 row, summed in float64 and rounded."""
    k = 64
    w = torch.randint(-3, 4, (64, k), generator=torch.Generator().manual_seed(1)).float()
    packed = quantize_packed(w, 8, 32)
    x = torch.randint(-2, 3, (2, k), generator=torch.Generator().manual_seed(2)).float()
    y = torch.zeros(2, 60)
    y[0, [50, 3, 41, 7]] = 2.0                          # 4 equal leaders, then ties at 1.0
    y[0, [9, 30, 2, 59, 11, 40]] = 1.0
    y[1, :] = float("nan")
    y[1, 58] = 5.0
    exact = (x.double() @ dequantize(quantize(w, 8, 32)).double().t()).float()
    for threads in (1, 2, 4):
        got = y.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            native_ops(level).rescore_top.default(x, got, packed, None, 8, 32, RESCORED_ROWS)
        finally:
            torch.set_num_threads(before)
        chosen = [3, 7, 41, 50, 2, 9, 11, 30]               # the 2.0s, then the first four 1.0s by id
        want = y.clone()
        want[0, chosen] = exact[0, chosen]
        want[1, 58] = exact[1, 58]
        assert torch.equal(got.isnan(), y.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    short = y[:1, :5].clone()
    native_ops(level).rescore_top.default(x[:1], short, packed, None, 8, 32, RESCORED_ROWS)
    assert torch.equal(short, exact[:1, :5])


@needs_native
def test_native_rescoring_refuses_what_does_not_fit():
    packed = quantize_packed(torch.randn(32, 64), 8, 32)
    with pytest.raises(ValueError, match="do not fit weights of 32 rows"):
        native_ops().rescore_top.default(torch.randn(1, 64), torch.randn(1, 48), packed, None, 8, 32, 8)
    with pytest.raises(ValueError, match="do not fit"):
        native_ops().rescore_top.default(torch.randn(1, 64), torch.randn(1, 32).bfloat16(), packed, None, 8, 32, 8)
    with pytest.raises(ValueError, match="is not int8 weights of 96 columns"):
        native_ops().rescore_top.default(torch.randn(1, 96), torch.randn(1, 32), packed, None, 8, 32, 8)


@needs_native_levels
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("zeros", [False, True])
def test_native_mlp_is_its_three_calls(level, bits, zeros):
    """mlp_quant: the quantized SwiGLU's products and activation in one call, the same bits as
    linear_quant, silu_mul, linear_quant at 1 to 17 rows, float32 and bf16, zero points or none."""
    ops = native_ops(level)
    gate_up = asymmetric_weight(2 * 96, 128, bits, 32, seed=bits)
    down = asymmetric_weight(80, 96, bits, 32, seed=bits + 1)
    gu_q, d_q = pack(gate_up), pack(down)
    gu_z, d_z = (pack_zeros(gate_up), pack_zeros(down)) if zeros else (None, None)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 2, 5, 17):
            x = torch.randn(m, 128, generator=g).to(dtype)
            want = ops.linear_quant(ops.silu_mul(ops.linear_quant(x, gu_q, gu_z, bits, 32)), d_q, d_z, bits, 32)
            got = ops.mlp_quant(x, gu_q, gu_z, d_q, d_z, bits, 32)
            assert got.dtype == dtype and got.shape == (m, 80)
            assert torch.equal(got, want), (dtype, m)
    with pytest.raises(ValueError, match=r"mlp_quant: gate_up \(\d+,\) and down .* are not packed weights"):
        ops.mlp_quant(torch.randn(1, 128), gu_q.flatten(), gu_z, d_q, d_z, bits, 32)
    with pytest.raises(ValueError, match=r"mlp_quant: down \(5, \d+\) does not take the 96 columns of gate_up"):
        ops.mlp_quant(torch.randn(1, 128), gu_q, gu_z, pack(asymmetric_weight(80, 64, bits, 32, seed=0)), None,
                      bits, 32)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native)])
@pytest.mark.parametrize("bits", [8, 4])
def test_method_swiglu_is_down_of_the_activated_gate_up(native, bits):
    """QuantizedLinearMethod.apply_swiglu: down(silu(gate) * up) of the merged gate_up layer,
    natively one mlp_quant call, the same bits as the three calls; a down layer of other bits
    takes the three calls."""
    from hybrid_engine.kernels.activation.cpu import silu_mul
    g = torch.Generator().manual_seed(4)
    method = QuantizedLinearMethod(bits, 32, native=native)
    gate_up = _layer(torch.randn(128, 64, generator=g) / 8, method, {"gate_proj": 64, "up_proj": 64})
    down = _layer(torch.randn(48, 64, generator=g) / 8, method)
    calls = []
    counting = _counting(torch.ops.hybrid_engine_cpu.mlp_quant if native else None, calls)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 64, generator=g).to(dtype)
        want = down(silu_mul(gate_up(x)))
        with mock.patch.object(torch.ops.hybrid_engine_cpu, "mlp_quant", counting, create=True):
            got = method.apply_swiglu(gate_up, down, x, silu_mul)
        assert torch.equal(got, want), dtype
    assert len(calls) == (2 if native else 0)
    other = _layer(torch.randn(48, 64, generator=g) / 8, QuantizedLinearMethod(12 - bits, 32, native=native))
    x = torch.randn(2, 64, generator=g)
    assert torch.equal(method.apply_swiglu(gate_up, other, x, silu_mul), other(silu_mul(gate_up(x))))
