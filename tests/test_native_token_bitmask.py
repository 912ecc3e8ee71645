"""kernels/sampling/token_bitmask.cpp: a structured output's token mask == the torch form
(kernels/sampling/reference.py) and xgrammar's own CPU kernel, bitwise, at every native level
this process may run; apply_token_bitmask takes the kernel for eager CPU calls and the torch
form where it cannot run."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from hybrid_engine.kernels.native.isa import LEVELS, at_least, cpu_level
from hybrid_engine.kernels.sampling import apply_token_bitmask_torch
from hybrid_engine.kernels.sampling import cpu as native
from hybrid_engine.kernels.sampling.cpu import apply_token_bitmask      # what the engine calls

from op_calls import recorded_calls

NATIVE_LEVELS = [lvl for lvl in LEVELS[1:] if at_least(lvl)]
NO_NATIVE = ("CPU level none: no native kernel may run; "
             "test_apply_token_bitmask_takes_the_kernel_where_it_runs checks the torch form")


def masks(rows: int, vocab: int, seed: int, words: int | None = None) -> torch.Tensor:
    """Rows of every kind a grammar gives: random bits, all allowed, none, a few allowed, runs."""
    g = torch.Generator().manual_seed(seed)
    words = words or (vocab + 31) // 32
    m = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    if rows > 1:
        m[1] = -1                                    # an unconstrained row: untouched
    if rows > 2:
        m[2] = 0                                     # nothing allowed
    if rows > 3:
        m[3] = 0
        m[3, ::7] = 1 << 5                           # one token in each seventh word
    if rows > 4:
        m[4, : words // 2] = -1                      # a run of allowed words, then random
    return m


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
@pytest.mark.parametrize("level", NATIVE_LEVELS)
@pytest.mark.parametrize("rows, vocab", [(1, 3072), (5, 3072), (6, 248320), (7, 1000), (5, 33), (5, 31)])
def test_native_matches_the_torch_form_and_xgrammar(level, rows, vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g)
    logits[0, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    bitmask = masks(rows, vocab, seed=rows)
    want, theirs = logits.clone(), logits.clone()
    apply_token_bitmask_torch(want, bitmask)
    xgr.apply_token_bitmask_inplace(theirs, bitmask)
    native.apply_token_bitmask_native(logits, bitmask, level=level)
    assert torch.equal(logits.isnan(), want.isnan())
    assert torch.equal(logits.nan_to_num(0.0), want.nan_to_num(0.0))
    assert torch.equal(want.nan_to_num(0.0), theirs.nan_to_num(0.0))
    if rows > 2:
        assert bool((logits[2] == float("-inf")).all())


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_native_reads_strided_rows_and_wider_masks():
    wide = torch.randn(4, 3100, generator=torch.Generator().manual_seed(1))
    logits = wide[:, 10:3082]                                              # rows strided
    bitmask = masks(4, 3072, seed=2, words=100)[:, :97]                   # more words than tokens need
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask)
    untouched = wide[:, :10].clone()
    native.apply_token_bitmask_native(logits, bitmask)
    assert torch.equal(logits, want) and torch.equal(wide[:, :10], untouched)


def test_apply_token_bitmask_takes_the_kernel_where_it_runs():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(5))
    bitmask = masks(3, 100, seed=6)
    want = logits.clone()
    apply_token_bitmask_torch(want, bitmask)
    with recorded_calls("apply_token_bitmask") as calls:
        apply_token_bitmask(logits, bitmask)
    assert bool(calls) == (cpu_level() != "none")
    assert torch.equal(logits, want)
    assert not native.can_run_native(logits.double(), bitmask)
    assert not native.can_run_native(logits, bitmask[:, :3])              # too few words
    assert not native.can_run_native(logits[:2], bitmask)                 # rows differ


@pytest.mark.skipif(not NATIVE_LEVELS, reason=NO_NATIVE)
def test_the_op_refuses_what_it_cannot_take_naming_it():
    logits, bitmask = torch.randn(3, 100), masks(3, 100, seed=7)
    with pytest.raises(ValueError, match=r"apply_token_bitmask: no kernel for logits torch.float32 \(3, 100\) "
                                         r"and bitmask torch.int32 \(3, 2\)"):
        native.native_ops().apply_token_bitmask.default(logits, bitmask[:, :2])
