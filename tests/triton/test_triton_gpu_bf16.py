"""bf16 at Qwen3.5-0.8B dimensions, triton against the torch ops on the same GPU inputs.

The interpreter cannot run bf16 (triton issue #11584), so these run only with CUDA
(benchmarks/gpu_check.py). Errors are relative Frobenius norms: bf16 rounds elementwise.
"""

from __future__ import annotations

import pytest
import torch
from triton_cases import TORCH, make_cu

from hybrid_engine import kernels
from hybrid_engine.kernels import triton_backend

tk = triton_backend()     # the triton form of every op (the torch form where it has none)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 kernels need a GPU")

BF = torch.bfloat16
HV, DK, DV, CONV_DIM, K = 16, 128, 128, 6144, 4          # GDN: 16 heads of 128, conv over q|k|v
NH, NKV, HD, ROT, HIDDEN = 8, 2, 256, 64, 1024           # gated attention


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def _randn(*shape, scale=1.0, dtype=BF):
    return (scale * torch.randn(*shape, device="cuda")).to(dtype)


def test_gdn_chunk_prefill_bf16():
    torch.manual_seed(0)
    lengths = [1500, 548]
    T = sum(lengths)
    q, k, v = _randn(T, HV, DK), _randn(T, HV, DK), _randn(T, HV, DV)
    g = -torch.rand(T, HV, device="cuda") * 2
    beta = torch.rand(T, HV, device="cuda").to(BF)
    init = _randn(2, HV, DK, DV, scale=0.1, dtype=torch.float32)
    cu_seqlens = make_cu(lengths, "cuda")
    o, final = tk.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, init)
    o_ref, final_ref = TORCH["chunk_gated_delta_rule"](q, k, v, g, beta, cu_seqlens, init)
    assert o.dtype == BF and final.dtype == torch.float32
    assert _rel(o, o_ref) < 2e-2 and _rel(final, final_ref) < 2e-2


def test_gdn_decode_verify_bf16():
    torch.manual_seed(1)
    B, T = 64, 3
    q, k, v = _randn(B, T, HV, DK), _randn(B, T, HV, DK), _randn(B, T, HV, DV)
    pool = _randn(4 * B, HV, DK, DV, scale=0.1, dtype=torch.float32)
    read = torch.arange(B, device="cuda") * 4
    write = read[:, None] + torch.arange(1, T + 1, device="cuda")       # draft slots per position
    write[:, -1] = read                                                 # last one in place
    pool_ref = pool.clone()
    g = -torch.rand(B, T, HV, device="cuda") * 2
    beta = torch.rand(B, T, HV, device="cuda").to(BF)
    o = tk.recurrent_gated_delta_rule(q, k, v, g, beta, pool, read, write)
    o_ref = TORCH["recurrent_gated_delta_rule"](q, k, v, g, beta, pool_ref, read, write)
    assert _rel(o, o_ref) < 2e-2 and _rel(pool, pool_ref) < 1e-3


def test_conv_prefill_and_update_bf16():
    torch.manual_seed(2)
    lengths = [1500, 548]
    x = _randn(sum(lengths), CONV_DIM)
    w = _randn(CONV_DIM, K, scale=0.5)
    window = _randn(2, CONV_DIM, K - 1)
    y, final = tk.causal_conv1d_varlen(x, w, make_cu(lengths, "cuda"), window)
    y_ref, final_ref = TORCH["causal_conv1d_varlen"](x, w, make_cu(lengths, "cuda"), window)
    assert _rel(y, y_ref) < 1e-2 and torch.equal(final, final_ref)

    B, T = 64, 3
    x = _randn(B, T, CONV_DIM)
    pool = _randn(4 * B, CONV_DIM, K - 1)
    read = torch.arange(B, device="cuda") * 4
    write = read[:, None] + torch.arange(1, T + 1, device="cuda")
    pool_ref = pool.clone()
    y = tk.causal_conv1d_update(x, w, pool, read, write)
    y_ref = TORCH["causal_conv1d_update"](x, w, pool_ref, read, write)
    assert _rel(y, y_ref) < 1e-2 and torch.equal(pool, pool_ref)


@pytest.mark.parametrize("new", [[512] + [1] * 64, [3] * 64], ids=["prefill+decodes", "verify"])
def test_paged_attention_bf16(new):
    torch.manual_seed(3)
    block_size = 16
    cached = torch.randint(0, 2000, (len(new),)).tolist()
    totals = [c + n for c, n in zip(cached, new)]
    need = [-(-L // block_size) for L in totals]
    num_blocks = sum(need) + 1
    kv_cache = torch.full((num_blocks, 2, block_size, NKV, HD), float("nan"), device="cuda", dtype=BF)
    perm = torch.randperm(num_blocks, device="cuda")
    bt = torch.full((len(new), max(need)), -1, dtype=torch.int64, device="cuda")
    start = 0
    for n, L in enumerate(totals):
        bt[n, :need[n]] = perm[start:start + need[n]]
        start += need[n]
        pos = torch.arange(L, device="cuda")
        tk.write_kv_cache(_randn(L, NKV, HD), _randn(L, NKV, HD), kv_cache, bt[n, pos // block_size] * block_size + pos % block_size)
    q = _randn(sum(new), NH, HD)
    cu_q, seq_lens = make_cu(new, "cuda"), torch.tensor(totals, device="cuda")
    o = tk.paged_attention(q, kv_cache, bt, cu_q, seq_lens, HD ** -0.5)
    o_ref = TORCH["paged_attention"](q, kv_cache, bt, cu_q, seq_lens, HD ** -0.5)
    assert _rel(o, o_ref) < 2e-2


def test_norms_and_rope_bf16():
    torch.manual_seed(4)
    T = 2048
    x, w = _randn(T, HIDDEN, scale=3), _randn(HIDDEN, scale=0.1)
    assert _rel(tk.rms_norm(x, w, 1e-6), TORCH["rms_norm"](x, w, 1e-6)) < 1e-2
    o, z, w_g = _randn(T, HV, DV), _randn(T, HV, DV), 1 + _randn(DV, scale=0.1)
    assert _rel(tk.gated_rms_norm(o, z, w_g, 1e-6), TORCH["gated_rms_norm"](o, z, w_g, 1e-6)) < 1e-2
    q = _randn(T, NH, 2 * HD).chunk(2, dim=-1)[0]
    k = _randn(T, NKV, HD)
    w_q, w_k = _randn(HD, scale=0.1), _randn(HD, scale=0.1)
    cos, sin = kernels.rope_cos_sin(torch.arange(T, device="cuda") + 1000, ROT, 1e7, BF)
    for out, ref in zip(tk.qk_norm_rope(q, k, w_q, w_k, 1e-6, cos, sin),
                        TORCH["qk_norm_rope"](q, k, w_q, w_k, 1e-6, cos, sin)):
        assert _rel(out, ref) < 1e-2
