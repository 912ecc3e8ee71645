"""Torch kernel backend: every fast op against a plain reference, on tiny float32 shapes."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from hybrid_engine.kernels import (
    apply_partial_rope,
    causal_conv1d_update,
    causal_conv1d_varlen,
    chunk_gated_delta_rule,
    cpu_backend,
    gated_rms_norm,
    naive_gated_delta_rule,
    paged_attention,
    recurrent_gated_delta_rule,
    rms_norm,
    rope_cos_sin,
    torch_backend,
    write_kv_cache,
)
from hybrid_engine.kernels.native.isa import cpu_level
from hybrid_engine.kernels.gdn import recurrent as recurrent_module
from hybrid_engine.kernels.attention import attention_layout, naive_paged_attention
from hybrid_engine.kernels.norm import gated_rms_norm_torch, rms_norm_torch
from hybrid_engine.kernels.slot_pool import DecodeRows

from kernel_cases import gdn_inputs, make_cu, paged_kv_case


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny shapes on a shared 2-core box: more threads only add contention.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------- gated delta rule

@pytest.mark.parametrize("chunk_size", [64, 16])
def test_chunk_matches_naive_varlen(chunk_size):
    lengths = [1, 7, 64, 0, 65, 130]
    Hv, dk, dv = 4, 16, 8
    q, k, v, g, beta = gdn_inputs(sum(lengths))
    cu = make_cu(lengths)
    init = 0.5 * torch.randn(len(lengths), Hv, dk, dv, generator=torch.Generator().manual_seed(1))
    init_copy = init.clone()

    o, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, init, chunk_size=chunk_size)

    assert o.shape == v.shape and o.dtype == torch.float32
    assert final.shape == init.shape and final.dtype == torch.float32
    assert torch.equal(init, init_copy)
    for n in range(len(lengths)):
        s = slice(cu[n], cu[n + 1])
        o_ref, final_ref = naive_gated_delta_rule(q[s], k[s], v[s], g[s], beta[s], init[n])
        torch.testing.assert_close(o[s], o_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[n], final_ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(final[3], init[3])           # an empty sequence passes its state through


def test_chunk_matches_transformers_reference():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    hf_chunk = inspect.unwrap(m.torch_chunk_gated_delta_rule)
    T, Hv, dk, dv = 100, 4, 16, 8
    q, k, v, g, beta = gdn_inputs(T, seed=2)
    init = 0.5 * torch.randn(1, Hv, dk, dv, generator=torch.Generator().manual_seed(3))

    o, final = chunk_gated_delta_rule(q, k, v, g, beta, make_cu([T]), init)
    # HF layout [B, T, H, D]; it repeat_interleaves q/k to the value heads itself
    o_hf, final_hf = hf_chunk(q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
                              initial_state=init, output_final_state=True,
                              use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_hf, atol=1e-5, rtol=1e-5)


def test_chunk_scale_and_no_l2norm_match_naive():
    q, k, v, g, beta = gdn_inputs(40, seed=4)
    q, k = 0.3 * q, 0.3 * k                            # keep the un-normalised rule stable
    init = torch.zeros(1, 4, 16, 8)
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, make_cu([40]), init, scale=0.7, use_qk_l2norm=False)
    o_ref, final_ref = naive_gated_delta_rule(q, k, v, g, beta, None, scale=0.7, use_qk_l2norm=False)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final[0], final_ref, atol=1e-5, rtol=1e-5)


def _recurrent_case(B, T, seed):
    Hk, Hv, dk, dv = 2, 4, 16, 8
    q, k, v, g, beta = gdn_inputs(B * T, Hk, Hv, dk, dv, seed=seed)
    q, k = q.view(B, T, Hk, dk), k.view(B, T, Hk, dk)
    v, g, beta = v.view(B, T, Hv, dv), g.view(B, T, Hv), beta.view(B, T, Hv)
    pool = torch.randn(16, Hv, dk, dv, generator=torch.Generator().manual_seed(seed + 1))
    return q, k, v, g, beta, pool


def traced(op):
    """op under torch.compile, tracing only (backend="eager": no inductor, fast) and in one
    graph: the op takes its paths for compiled steps, which must read nothing back to the host."""
    return torch.compile(op, backend="eager", fullgraph=True, dynamic=False)


# small: tiny states; large: the large-state (in place) path forced on them; traced: under torch.compile
@pytest.mark.parametrize("path", ["small", "large", "traced"])
@pytest.mark.parametrize("read, write", [
    ([4, 0, 7], [[4], [0], [7]]),                      # plain decode: in place
    ([4, 0, 7], [[0], [7], [4]]),                      # each row writes another row's read slot
    ([4, 0, 7], [[1, 2, 3], [5, 6, 8], [9, 10, 7]]),   # verify: one slot per draft position
])
def test_recurrent_pool_matches_naive(read, write, path, monkeypatch):
    if path == "large":
        monkeypatch.setattr(recurrent_module, "IN_PLACE_MIN_BYTES", 0)
    read, write = torch.tensor(read), torch.tensor(write)
    B, T = write.shape
    q, k, v, g, beta, pool = _recurrent_case(B, T, seed=5)
    before = pool.clone()

    if path == "traced":     # with the step's rows, as compiled steps get them: no read-back
        o = traced(recurrent_gated_delta_rule)(q, k, v, g, beta, pool, read, write,
                                               rows=DecodeRows.of_tensors(read, write).without_ids())
    else:
        o = recurrent_gated_delta_rule(q, k, v, g, beta, pool, read, write)

    assert o.shape == v.shape
    for b in range(B):
        o_ref, _ = naive_gated_delta_rule(q[b], k[b], v[b], g[b], beta[b], before[read[b]])
        torch.testing.assert_close(o[b], o_ref, atol=1e-5, rtol=1e-5)
        for t in range(T):
            _, state_t = naive_gated_delta_rule(q[b, :t + 1], k[b, :t + 1], v[b, :t + 1],
                                                g[b, :t + 1], beta[b, :t + 1], before[read[b]])
            torch.testing.assert_close(pool[write[b, t]], state_t, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(len(pool), dtype=torch.bool)
    untouched[write.flatten()] = False
    assert torch.equal(pool[untouched], before[untouched])


def test_recurrent_skips_negative_write_slots():
    q, k, v, g, beta, pool = _recurrent_case(2, 2, seed=6)
    before = pool.clone()
    recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([3, 4]),
                               torch.tensor([[5, 6], [7, -1]]))
    changed = (pool != before).flatten(1).any(1).nonzero().flatten().tolist()
    assert changed == [5, 6, 7]


def test_repeated_write_slot_keeps_last_token():
    q, k, v, g, beta, pool = _recurrent_case(1, 3, seed=9)
    init = pool[0].clone()
    recurrent_gated_delta_rule(q, k, v, g, beta, pool, torch.tensor([0]), torch.tensor([[0, 0, 0]]))
    _, final = naive_gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], init)
    torch.testing.assert_close(pool[0], final, atol=1e-5, rtol=1e-5)

    x, weight = torch.randn(1, 3, 6), torch.randn(6, 4)
    windows = torch.randn(2, 6, 3)
    causal_conv1d_update(x, weight, windows, torch.tensor([1]), torch.tensor([[1, 1, 1]]))
    assert torch.equal(windows[1], x[0].t())


def test_recurrent_steps_match_chunk_prefill():
    # decode token by token from slot 2 == one chunked prefill over the same tokens
    T = 9
    q, k, v, g, beta = gdn_inputs(T, seed=7)
    pool = torch.zeros(4, 4, 16, 8)
    pool[2] = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(8))
    o_chunk, final = chunk_gated_delta_rule(q, k, v, g, beta, make_cu([T]), pool[2:3].clone())
    slot = torch.tensor([2])
    outs = [recurrent_gated_delta_rule(q[t][None, None], k[t][None, None], v[t][None, None],
                                       g[t][None, None], beta[t][None, None], pool, slot, slot[:, None])
            for t in range(T)]
    torch.testing.assert_close(torch.cat(outs, 1)[0], o_chunk, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool[2], final[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- causal conv1d

def _conv_reference(x_seq, weight, window):
    """silu(conv) over window ++ inputs with plain F.conv1d, and the last K-1 inputs."""
    xx = torch.cat([window, x_seq.t()], dim=-1)                      # [D, K-1+L]
    if len(x_seq) == 0:
        return x_seq, window
    y = F.silu(F.conv1d(xx[None], weight[:, None], groups=weight.shape[0]))[0].t()
    return y, xx[:, -(weight.shape[1] - 1):]


def test_conv_varlen_matches_per_sequence_conv():
    D, K = 6, 4
    lengths = [5, 1, 2, 0, 9]                          # 1 and 2 are shorter than the window
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(sum(lengths), D, generator=gen)
    weight = torch.randn(D, K, generator=gen)
    window = torch.randn(len(lengths), D, K - 1, generator=gen)
    window[0] = 0                                      # a fresh sequence
    cu = make_cu(lengths)

    y, final = causal_conv1d_varlen(x, weight, cu, window)

    assert y.shape == x.shape and final.shape == window.shape
    for n in range(len(lengths)):
        y_ref, final_ref = _conv_reference(x[cu[n]:cu[n + 1]], weight, window[n])
        torch.testing.assert_close(y[cu[n]:cu[n + 1]], y_ref, atol=1e-6, rtol=1e-6)
        assert torch.equal(final[n], final_ref)
    assert torch.equal(final[1], torch.cat([window[1, :, 1:], x[5:6].t()], -1))
    assert torch.equal(final[3], window[3])


def test_conv_update_matches_varlen():
    D, K, B, T = 6, 4, 3, 3
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(B, T, D, generator=gen)
    weight = torch.randn(D, K, generator=gen)
    pool = torch.randn(10, D, K - 1, generator=gen)
    before = pool.clone()
    read = torch.tensor([2, 5, 0])
    write = torch.tensor([[1, 3, 4], [6, 7, 2], [8, 9, 0]])    # row 1 writes row 0's read slot

    y = causal_conv1d_update(x, weight, pool, read, write)

    for b in range(B):
        y_ref, _ = causal_conv1d_varlen(x[b], weight, make_cu([T]), before[read[b]][None])
        torch.testing.assert_close(y[b], y_ref, atol=1e-6, rtol=1e-6)
        for t in range(T):
            _, window_t = causal_conv1d_varlen(x[b, :t + 1], weight, make_cu([t + 1]), before[read[b]][None])
            assert torch.equal(pool[write[b, t]], window_t[0])
    assert torch.equal(pool[5], before[5])


def test_conv_decode_steps_match_varlen():
    D, K, T = 6, 4, 5
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(2, T, D, generator=gen)
    weight = torch.randn(D, K, generator=gen)
    pool = torch.zeros(3, D, K - 1)
    slots = torch.tensor([2, 0])
    ys = [causal_conv1d_update(x[:, t:t + 1], weight, pool, slots, slots[:, None]) for t in range(T)]
    y_ref, final_ref = causal_conv1d_varlen(x.reshape(2 * T, D), weight, make_cu([T, T]),
                                            torch.zeros(2, D, K - 1))
    torch.testing.assert_close(torch.cat(ys, 1).reshape(2 * T, D), y_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool[slots], final_ref)
    assert torch.equal(pool[1], torch.zeros(D, K - 1))


# ---------------------------------------------------------------- norms, rope

def test_norms_match_transformers_modules():
    """The torch forms bitwise (the native kernel, within an ulp of them: tests/test_native_norm.py)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    gen = torch.Generator().manual_seed(13)
    for dtype in (torch.float32, torch.bfloat16):
        x = (3 * torch.randn(5, 3, 32, generator=gen)).to(dtype)
        z = torch.randn(5, 3, 32, generator=gen).to(dtype)
        w = (0.1 * torch.randn(32, generator=gen)).to(dtype)
        ref = m.Qwen3_5RMSNorm(32, eps=1e-6).to(dtype)
        ref.weight.data.copy_(w)
        gated = m.Qwen3_5RMSNormGated(32, eps=1e-6).to(dtype)
        gated.weight.data.copy_(1 + w)
        with torch.no_grad():
            assert torch.equal(rms_norm_torch(x, w, 1e-6), ref(x))
            assert torch.equal(gated_rms_norm_torch(x, z, 1 + w, 1e-6), gated(x, z))


def test_norm_formulas():
    gen = torch.Generator().manual_seed(14)
    x, z = torch.randn(2, 4, 16, generator=gen)
    w = torch.randn(16, generator=gen)
    rms = (x.double().pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
    torch.testing.assert_close(rms_norm(x, w, 1e-6).double(), x.double() / rms * (1 + w.double()))
    torch.testing.assert_close(gated_rms_norm(x, z, w, 1e-6).double(),
                               w.double() * x.double() / rms * F.silu(z.double()))


def test_rope_matches_direct_rotation():
    T, H, hd, rot, theta = 6, 3, 32, 8, 1e7
    positions = torch.tensor([0, 1, 2, 7, 100, 4095])
    x = torch.randn(T, H, hd, generator=torch.Generator().manual_seed(15))
    cos, sin = rope_cos_sin(positions, rot, theta, torch.float32)
    y = apply_partial_rope(x, cos, sin)

    assert cos.shape == sin.shape == (T, rot)
    j = torch.arange(rot // 2, dtype=torch.float64)
    angle = positions[:, None].double() * theta ** (-2 * j / rot)      # [T, rot/2]
    c, s = angle.cos()[:, None], angle.sin()[:, None]
    a, b = x[..., : rot // 2].double(), x[..., rot // 2: rot].double()  # pair (j, j + rot/2)
    torch.testing.assert_close(y[..., : rot // 2].double(), a * c - b * s, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(y[..., rot // 2: rot].double(), b * c + a * s, atol=1e-5, rtol=1e-5)
    assert torch.equal(y[..., rot:], x[..., rot:])
    torch.testing.assert_close(y[..., :rot].norm(dim=-1), x[..., :rot].norm(dim=-1))
    assert torch.equal(y[0], x[0])                                      # position 0: identity


def test_rope_matches_transformers_apply():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    T, H, hd, rot = 5, 2, 16, 4
    x = torch.randn(T, H, hd, generator=torch.Generator().manual_seed(16)).bfloat16()
    cos, sin = rope_cos_sin(torch.arange(10, 10 + T), rot, 1e7, torch.bfloat16)
    ref, _ = m.apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_partial_rope(x, cos, sin), ref[0].transpose(0, 1))


# ---------------------------------------------------------------- paged attention

NH, NKV, HD = 4, 2, 8


def _paged_setup(block_size, cached, new, seed):
    """A NaN-filled cache holding the sequences' keys in shuffled blocks, plus dense copies."""
    return paged_kv_case(block_size, cached, new, seed, NH, NKV, HD, write_kv_cache)


def _dense_reference(q, cu, keys, values, scale):
    out = []
    for n in range(len(keys)):
        qn = q[cu[n]:cu[n + 1]].transpose(0, 1)                       # [nh, Q, hd]
        Q, L = qn.shape[1], keys[n].shape[0]
        k = keys[n].transpose(0, 1).repeat_interleave(NH // NKV, 0)  # [nh, L, hd]
        v = values[n].transpose(0, 1).repeat_interleave(NH // NKV, 0)
        mask = torch.ones(Q, L, dtype=torch.bool).tril(L - Q)         # causal, bottom-right aligned
        out.append(F.scaled_dot_product_attention(qn, k, v, attn_mask=mask, scale=scale).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_mixed_batch_matches_dense(block_size):
    cached = [20, 0, 33, 10, 47]
    new = [5, 7, 1, 1, 3]                     # prefill chunks, a fresh prefill, decodes, a verify
    q, kv_cache, bt, cu, seq_lens, keys, values = _paged_setup(block_size, cached, new, seed=20)
    o = paged_attention(q, kv_cache, bt, cu, seq_lens, scale=HD ** -0.5)
    torch.testing.assert_close(o, _dense_reference(q, cu, keys, values, HD ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, qlen, n", [(1, 1, 4), (16, 1, 4), (16, 3, 4), (16, 1, 1), (4, 2, 1)])
def test_paged_attention_traced_path_matches_dense(block_size, qlen, n):
    """Under torch.compile, given the step's layout, nothing is read back; keys are gathered
    over the block table's whole width and masked by length; the table's tails hold -1 and
    the cache NaN."""
    q, kv_cache, bt, cu, seq_lens, keys, values = _paged_setup(block_size, [0, 20, 47, 5][:n], [qlen] * n, seed=22)
    layout = attention_layout(bt, seq_lens, [qlen] * n, block_size, slots_valid=True)
    o = traced(paged_attention)(q, kv_cache, bt, cu, seq_lens, 0.3, layout)
    torch.testing.assert_close(o, _dense_reference(q, cu, keys, values, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, qlen", [(1, 1), (16, 1), (32, 1), (16, 3)])
def test_paged_attention_batched_path_matches_per_sequence(block_size, qlen):
    cached = [0, 20, 47, 5]
    new = [qlen] * 4
    q, kv_cache, bt, cu, seq_lens, keys, values = _paged_setup(block_size, cached, new, seed=21)
    o = paged_attention(q, kv_cache, bt, cu, seq_lens, scale=0.3)
    for n in range(4):
        s = slice(cu[n], cu[n + 1])
        o_n = paged_attention(q[s], kv_cache, bt[n:n + 1], make_cu([qlen]), seq_lens[n:n + 1], scale=0.3)
        torch.testing.assert_close(o[s], o_n, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o, _dense_reference(q, cu, keys, values, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size, qlen", [(16, 1), (4, 3)])
def test_a_layout_without_keys_is_read_in_place_or_refused(block_size, qlen):
    """Where the cpu backend says attention reads no keys (its native kernel reads the blocks in
    place), a layout the builder left them out of gives what the full layout gives; the torch
    reference, which always reads them, refuses such a layout with an error saying why."""
    q, kv_cache, bt, cu, seq_lens, keys, values = paged_kv_case(block_size, [0, 20, 47, 5], [qlen] * 4, 24,
                                                                NH, NKV, 16, write_kv_cache)   # hd the kernel takes
    full = attention_layout(bt, seq_lens, [qlen] * 4, block_size, slots_valid=True)
    keyless = attention_layout(bt, seq_lens, [qlen] * 4, block_size, slots_valid=True, keyless={qlen})
    assert full.keys is not None and keyless.keys is None and keyless.query_len == qlen
    with pytest.raises(ValueError, match="has no keys"):
        paged_attention(q, kv_cache, bt, cu, seq_lens, 0.3, keyless)
    cpu = cpu_backend()
    assert torch_backend().attention_reads_keys(kv_cache, q.shape[1], qlen)
    if cpu.attention_reads_keys(kv_cache, q.shape[1], qlen):
        assert cpu_level() == "none"
        return
    o = cpu.paged_attention(q, kv_cache, bt, cu, seq_lens, 0.3, keyless)
    torch.testing.assert_close(o, paged_attention(q, kv_cache, bt, cu, seq_lens, 0.3, full), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(o, _dense_reference(q, cu, keys, values, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size, cached, new", [
    (16, [37], [1]),                                  # batch-1 decode
    (4, [0, 20, 47, 5], [1, 1, 1, 1]),                # decodes
    (16, [9, 30, 2], [3, 3, 3]),                      # verify, k = 2
    (16, [20, 0, 33, 10, 47], [5, 7, 1, 1, 3]),       # mixed: chunks, a fresh prefill, decodes, a verify
])
def test_paged_attention_matches_the_naive_reference(block_size, cached, new, dtype):
    """The batched op (one gather per query length, in the cache's dtype, with the step's
    layout) against the per-sequence float32 reference, on a NaN-filled shuffled cache."""
    q, kv_cache, bt, cu, seq_lens, _, _ = _paged_setup(block_size, cached, new, seed=23)
    q, kv_cache = q.to(dtype), kv_cache.to(dtype)
    layout = attention_layout(bt, seq_lens, new, block_size, slots_valid=True)
    o = paged_attention(q, kv_cache, bt, cu, seq_lens, 0.3, layout)
    want = naive_paged_attention(q, kv_cache, bt, cu, seq_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), want.float(), atol=tol, rtol=tol)
    assert o.dtype == dtype


def test_decode_rows_from_lists():
    plain = DecodeRows.of_lists([4, 0], [[4], [0]])
    assert (plain.writes_valid, plain.independent, plain.in_place, plain.read_ids) == (True, True, True, (4, 0))
    verify = DecodeRows.of_lists([4, 0], [[4, 5], [0, -1]])
    assert (verify.writes_valid, verify.independent, verify.in_place) == (False, True, False)
    shared = DecodeRows.of_lists([3, 3], [[1], [2]])          # padding rows reading one scratch slot
    assert not shared.independent and shared.without_ids().read_ids is None


def test_write_kv_cache_places_entries_and_skips_padding():
    kv_cache = torch.zeros(4, 2, 2, NKV, HD)
    k, v = torch.randn(3, NKV, HD), torch.randn(3, NKV, HD)
    write_kv_cache(k, v, kv_cache, torch.tensor([5, -1, 0]))
    assert torch.equal(kv_cache[2, 0, 1], k[0]) and torch.equal(kv_cache[2, 1, 1], v[0])
    assert torch.equal(kv_cache[0, 0, 0], k[2]) and torch.equal(kv_cache[0, 1, 0], v[2])
    assert int((kv_cache != 0).flatten(2).any(-1).sum()) == 4       # nothing else written


# ---------------------------------------------------------------- bf16

def test_bf16_inputs_give_bf16_outputs_and_fp32_states():
    bf = torch.bfloat16
    q, k, v, g, beta = gdn_inputs(70, seed=30)
    init = torch.zeros(2, 4, 16, 8)
    cu = make_cu([30, 40])
    o32, s32 = chunk_gated_delta_rule(q, k, v, g, beta, cu, init)
    o16, s16 = chunk_gated_delta_rule(q.to(bf), k.to(bf), v.to(bf), g, beta.to(bf), cu, init)
    assert o16.dtype == bf and s16.dtype == torch.float32
    torch.testing.assert_close(o16.float(), o32, atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(s16, s32, atol=5e-2, rtol=5e-2)

    pool = torch.zeros(3, 4, 16, 8)
    slot = torch.tensor([1])
    o_rec = recurrent_gated_delta_rule(q[None, :1].to(bf), k[None, :1].to(bf), v[None, :1].to(bf),
                                       g[None, :1], beta[None, :1].to(bf), pool, slot, slot[:, None])
    assert o_rec.dtype == bf and pool.dtype == torch.float32

    x = torch.randn(7, 6).to(bf)
    y, window = causal_conv1d_varlen(x, torch.randn(6, 4).to(bf), make_cu([7]), torch.zeros(1, 6, 3, dtype=bf))
    assert y.dtype == window.dtype == bf

    q_att, kv_cache, bt, cu_q, seq_lens, keys, values = _paged_setup(16, [3, 9], [2, 1], seed=31)
    o_att = paged_attention(q_att.to(bf), kv_cache.to(bf), bt, cu_q, seq_lens, scale=0.3)
    assert o_att.dtype == bf
    torch.testing.assert_close(o_att.float(), _dense_reference(q_att, cu_q, keys, values, 0.3),
                               atol=5e-2, rtol=5e-2)
