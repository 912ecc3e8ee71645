"""Triton norms, partial RoPE and the fused q/k-norm + RoPE against the torch ops, and the
kernel backends that hand them out."""

from __future__ import annotations

import pytest
import torch
from triton_cases import TORCH

from hybrid_engine import kernels
from hybrid_engine.kernels import triton_backend

tk = triton_backend()     # the triton form of every op (the torch form where it has none)


def _qk(device, T=5, nh=4, nkv=2, hd=32, seed=30):
    gen = torch.Generator().manual_seed(seed)
    # q as the model has it: a view of the [q | gate] projection, head stride 2 * hd
    q = (3 * torch.randn(T, nh, 2 * hd, generator=gen)).to(device).chunk(2, dim=-1)[0]
    k = (3 * torch.randn(T, nkv, hd, generator=gen)).to(device)
    w_q, w_k = (0.1 * torch.randn(2, hd, generator=gen)).to(device)
    cos, sin = kernels.rope_cos_sin(torch.tensor([0, 1, 7, 100, 4095], device=device), hd // 4, 1e7, torch.float32)
    return q, k, w_q, w_k, cos, sin


def test_rms_norm_matches_torch(device):
    q, *_ = _qk(device)
    w = torch.randn(q.shape[-1], device=device)
    assert not q.is_contiguous()
    torch.testing.assert_close(tk.rms_norm(q, w, 1e-6), TORCH["rms_norm"](q, w, 1e-6), atol=1e-5, rtol=1e-5)
    x = torch.randn(3, 100, device=device)                 # a row length that is not a power of two
    w = torch.randn(100, device=device)
    torch.testing.assert_close(tk.rms_norm(x, w, 1e-6), TORCH["rms_norm"](x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_add_rms_norm_matches_torch(device):
    gen = torch.Generator().manual_seed(32)
    x, h = (3 * torch.randn(2, 3, 100, generator=gen)).to(device)
    w = (0.1 * torch.randn(100, generator=gen)).to(device)
    total, y = tk.add_rms_norm(x, h, w, 1e-6)
    want_total, want_y = TORCH["add_rms_norm"](x, h, w, 1e-6)
    assert torch.equal(total, want_total)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)


def test_gated_rms_norm_matches_torch(device):
    gen = torch.Generator().manual_seed(31)
    x, z = (3 * torch.randn(2, 6, 4, 24, generator=gen)).to(device)
    w = (1 + 0.1 * torch.randn(24, generator=gen)).to(device)
    torch.testing.assert_close(tk.gated_rms_norm(x, z, w, 1e-6), TORCH["gated_rms_norm"](x, z, w, 1e-6),
                               atol=1e-5, rtol=1e-5)


def test_partial_rope_matches_torch(device):
    q, k, _, _, cos, sin = _qk(device)
    torch.testing.assert_close(tk.apply_partial_rope(q, cos, sin), TORCH["apply_partial_rope"](q, cos, sin),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tk.apply_partial_rope(k, cos, sin), TORCH["apply_partial_rope"](k, cos, sin),
                               atol=1e-5, rtol=1e-5)


def test_qk_norm_rope_matches_torch(device):
    q, k, w_q, w_k, cos, sin = _qk(device)
    q_out, k_out = tk.qk_norm_rope(q, k, w_q, w_k, 1e-6, cos, sin)
    q_ref, k_ref = TORCH["qk_norm_rope"](q, k, w_q, w_k, 1e-6, cos, sin)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


def test_backends_take_their_ops(device):
    """The triton backend's norms are the triton kernels, the torch backend's the references;
    auto picks triton on CUDA only; a name that is no backend is refused."""
    triton = kernels.make_backend("triton", device)
    assert triton.rms_norm is tk.rms_norm and triton.qk_norm_rope is tk.qk_norm_rope
    assert kernels.make_backend("torch", device).rms_norm is TORCH["rms_norm"]
    assert kernels.make_backend("auto", device).name == ("triton" if device == "cuda" else kernels.make_backend(
        "auto", "cpu").name)
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kernels.make_backend("cuda", device)
