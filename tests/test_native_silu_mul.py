"""kernels/activation/silu_mul.cpp: the SwiGLU activation == the torch form (kernels/activation/reference.py
`silu_mul_torch`) at every native level this process may run; silu_mul takes the kernel for
eager CPU calls and the torch form where it cannot run (traced, autograd, other dtypes)."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.kernels.activation import silu_mul_torch
from hybrid_engine.kernels.activation.cpu import silu_mul      # the cpu backend's op
from hybrid_engine.kernels.activation import cpu as native
from hybrid_engine.kernels.native.isa import LEVELS, at_least, cpu_level

from op_calls import recorded_calls

NATIVE_LEVELS = [lvl for lvl in LEVELS[1:] if at_least(lvl)]
NO_NATIVE = "CPU level none: no native kernel may run; test_silu_mul_takes_the_kernel_where_it_runs checks the torch form"


def assert_same(got, want):
    """Bitwise, or one ulp where torch's SiLU took libm's exp on a tail shorter than its vector
    (the kernel takes the vector exp everywhere)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int32 if got.dtype == torch.float32 else torch.int16
    ulps = (got.view(bits).long() - want.view(bits).long()).abs()
    assert int(ulps.max()) <= 1, f"{int((ulps > 1).sum())} outputs more than one ulp apart"


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, inner", [(1, 3584), (1, 384), (3, 100), (5, 7), (40, 3584)])
def test_native_matches_the_torch_form(level, dtype, rows, inner):
    g = torch.Generator().manual_seed(rows * 1000 + inner)
    x = (torch.randn(rows, 2 * inner, generator=g) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)          # exp's ends, signed zero
    got = native.silu_mul_native(x, level=level)
    assert_same(got, silu_mul_torch(x))
    if inner % 16 == 0:                  # no tail: torch took the vector exp for every element
        assert torch.equal(got, silu_mul_torch(x))


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_reads_strided_rows_and_any_leading_dims():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(2, 3, 80, generator=g).bfloat16()
    x = wide[..., 8:72]                                                    # rows strided
    assert_same(native.silu_mul_native(x), silu_mul_torch(x))
    assert native.silu_mul_native(x).shape == (2, 3, 32)


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_output_does_not_depend_on_the_thread_count():
    x = torch.randn(4, 2 * 20000, generator=torch.Generator().manual_seed(4))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native.silu_mul_native(x)
        torch.set_num_threads(2)
        two = native.silu_mul_native(x)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_silu_mul_takes_the_kernel_where_it_runs():
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    with recorded_calls("silu_mul") as calls:
        got = silu_mul(x)
    assert bool(calls) == (cpu_level() != "none")
    assert_same(got, silu_mul_torch(x))
    assert not native.can_run_native(x.double())
    assert not native.can_run_native(torch.zeros(2, 7))                     # no [gate | up] halves
    assert not native.can_run_native(x.requires_grad_())                    # autograd: the torch form
    traced = torch.compile(silu_mul, backend="eager", fullgraph=True)
    with recorded_calls("silu_mul") as calls:
        traced(x.detach())
    assert not calls                                                        # traced: the torch form
