"""kernels/cpu/gdn_decode.cpp: plain decode in place == the torch in-place form and the naive rule."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.kernels.cpu.build import cpu_has
from hybrid_engine.kernels.cpu.gdn_decode import can_decode_in_place, gdn_decode_in_place
from hybrid_engine.kernels.gdn.recurrent import _decode_in_place

pytestmark = pytest.mark.skipif(not cpu_has("avx512f"), reason="the kernel needs AVX-512F")


@pytest.mark.parametrize("B,H,dk,dv", [(1, 1, 16, 16), (3, 4, 32, 32), (5, 2, 128, 128), (2, 3, 24, 48)])
def test_native_decode_matches_the_torch_in_place_form(B, H, dk, dv):
    g = torch.Generator().manual_seed(B * 100 + dk)
    pool = torch.randn(8, H, dk, dv, generator=g)
    assert can_decode_in_place(pool)
    slots = torch.randperm(8, generator=g)[:B]
    kq = torch.nn.functional.normalize(torch.randn(B, H, 2, dk, generator=g), dim=-1)
    decay = torch.rand(B, H, generator=g) * 0.5 + 0.5
    beta = torch.rand(B, H, generator=g)
    v = torch.randn(B, H, dv, generator=g)
    want_pool = pool.clone()
    qk = (kq[:, :, 0] * kq[:, :, 1]).sum(-1)[..., None, None]
    want = _decode_in_place(kq, qk, decay[..., None, None], beta[..., None, None], v[:, :, None, :],
                            want_pool, slots.tolist()).view(B, H, dv)
    got = gdn_decode_in_place(kq, decay, beta, v, pool, slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pool, want_pool, rtol=1e-5, atol=1e-5)   # other slots untouched too

    # and against the rule itself for one head: S' = a S + k u^T, u = beta (v - a S^T k), o = S'^T q
    b, h = B - 1, H - 1
    s0 = want_pool.new_tensor(torch.randn(dk, dv, generator=g))
    pool2 = torch.zeros(8, H, dk, dv)
    pool2[slots[b], h] = s0
    o2 = gdn_decode_in_place(kq, decay, beta, v, pool2, slots)
    k, q, a = kq[b, h, 0], kq[b, h, 1], decay[b, h]
    u = beta[b, h] * (v[b, h] - a * (s0.t() @ k))
    s1 = a * s0 + torch.outer(k, u)
    torch.testing.assert_close(pool2[slots[b], h], s1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o2[b, h], s1.t() @ q, rtol=1e-5, atol=1e-5)


def test_native_decode_declines_what_it_cannot_take():
    assert not can_decode_in_place(torch.zeros(2, 1, 8, 40))                 # dv not a multiple of 16
    assert not can_decode_in_place(torch.zeros(2, 1, 8, 32, dtype=torch.float64))
