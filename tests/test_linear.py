"""models/linear.py: every layout `linear` picks computes x W^T."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybrid_engine.models.linear import linear, pack_weight


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 16, 32, 33, 64])
def test_linear_matches_f_linear_at_every_row_count(rows):
    # 8..32 rows take the transposed float32 product, the others F.linear
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 96, generator=g)
    x = torch.randn(rows, 96, generator=g)
    out = linear(x, w)
    assert out.shape == (rows, 300) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 16])
def test_packed_bf16_linear_matches_f_linear(rows):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 96, generator=g).bfloat16()
    x = torch.randn(rows, 96, generator=g).bfloat16()
    torch.testing.assert_close(linear(x, pack_weight(w)).float(), F.linear(x, w).float(), rtol=2e-2, atol=2e-2)
