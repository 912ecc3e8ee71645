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


# ---- the native blocked kernel (kernels/cpu/blocked_linear.cpp) -------------------------------

from hybrid_engine.kernels.cpu import blocked as blocked_mod  # noqa: E402
from hybrid_engine.kernels.cpu.build import cpu_has  # noqa: E402
from hybrid_engine.kernels.cpu import block_weight, blocked_linear, blocked_linear_reference, native_available  # noqa: E402
from hybrid_engine.models import linear as linear_mod  # noqa: E402
from hybrid_engine.models.linear import can_pack, pack_weights  # noqa: E402

needs_native = pytest.mark.skipif(not cpu_has("avx512f"), reason="the kernel needs AVX-512F")


@needs_native
def test_native_kernel_builds_where_the_cpu_can_run_it():
    # a build failure would otherwise only show as slower products (every caller falls back)
    assert native_available()


@needs_native
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 100])
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


needs_bf16 = pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="the bf16 kernel needs AVX512-BF16")


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 16, 40])
@pytest.mark.parametrize("k", [128, 37])                 # odd K: the last pair padded
def test_blocked_bfloat16_matches_f_linear(rows, k):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, k, generator=g).bfloat16()
    x = torch.randn(rows, k, generator=g).bfloat16()
    assert block_weight(w).shape == (6, (k + 1) // 2, 16, 2)
    torch.testing.assert_close(blocked_linear_reference(x, block_weight(w)), F.linear(x, w), rtol=2e-2, atol=2e-2)
    out = blocked_linear(x, block_weight(w))
    assert out.dtype == torch.bfloat16
    # float32 accumulation, one rounding to bf16 at the end: within bf16's half-ulp of the exact product
    exact = F.linear(x.float(), w.float())
    torch.testing.assert_close(out.float(), exact, rtol=4e-3, atol=1e-3)


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
    wb = block_weight(torch.randn(48, 40, generator=g))
    f = torch.compile(lambda x: torch.relu(linear(x, wb)) * 2, dynamic=True)
    for rows in (1, 5, 12):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(f(x), torch.relu(blocked_linear_reference(x, wb)) * 2, rtol=1e-5, atol=1e-5)


@needs_native
def test_pack_weights_blocks_float32_and_leaves_odd_shapes(monkeypatch):
    from torch import nn
    m = nn.Module()
    m.a = nn.Linear(24, 32, bias=False)
    monkeypatch.setattr(linear_mod, "BLOCKED_MIN_BYTES", 0)  # (small weights stay plain by default)
    m.b = nn.Linear(24, 20, bias=False)                   # 20 rows: not blockable, stays as is
    x = torch.randn(4, 24)
    want_a, want_b = m.a(x), m.b(x)
    pack_weights(m, ["a.weight", "b.weight"])
    assert m.a.weight.shape == (2, 24, 16) and m.b.weight.shape == (20, 24)
    assert not can_pack(m.b.weight)
    torch.testing.assert_close(linear(x, m.a.weight), want_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, m.b.weight), want_b, rtol=1e-5, atol=1e-5)


def test_without_the_native_kernel_float32_weights_stay_plain(monkeypatch):
    monkeypatch.setattr(blocked_mod, "_library", lambda: None)
    assert not native_available() and not can_pack(torch.randn(1024, 1024))


@needs_native
def test_only_weights_of_a_megabyte_or_more_are_blocked():
    assert can_pack(torch.randn(256, 1024)) and not can_pack(torch.randn(240, 1024))


@needs_native
@pytest.mark.parametrize("tied", [True, False])
def test_blocked_lm_head_replaces_the_plain_weight_and_embeds_the_same(monkeypatch, tied):
    from checkpoints import make_config

    from hybrid_engine.models import HybridForCausalLM, parse_config
    monkeypatch.setattr(linear_mod, "BLOCKED_MIN_BYTES", 0)
    cfg = parse_config(make_config("qwen3_5", tie_word_embeddings=tied).to_dict())
    torch.manual_seed(0)
    model = HybridForCausalLM(cfg).eval()
    ids = torch.tensor([0, 5, 17, cfg.vocab_size - 1, 5])
    hidden = torch.randn(3, cfg.hidden_size)
    want_embeds, want_logits = model.embed(ids), model.compute_logits(hidden)
    model.pack_weights()
    assert model.packed_lm_head.dim() == 3 and model.lm_head_weight().is_meta   # no second copy
    torch.testing.assert_close(model.embed(ids), want_embeds, rtol=0, atol=0)
    torch.testing.assert_close(model.compute_logits(hidden), want_logits, rtol=1e-5, atol=1e-5)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 4, 5, 16])
def test_packed_bf16_weight_takes_its_blocked_twin_for_few_rows(monkeypatch, rows):
    from torch import nn
    monkeypatch.setattr(linear_mod, "BLOCKED_MIN_BYTES", 0)
    m = nn.Module()
    m.a = nn.Linear(64, 48, bias=False).bfloat16()
    x = torch.randn(rows, 64).bfloat16()
    exact = F.linear(x.float(), m.a.weight.float())
    pack_weights(m, ["a.weight"])
    assert m.a.weight.is_mkldnn and m.a.weight.few_rows.shape == (3, 32, 16, 2)
    calls = []
    monkeypatch.setattr(linear_mod, "blocked_linear", lambda *a: calls.append(1) or blocked_linear(*a))
    torch.testing.assert_close(linear(x, m.a.weight).float(), exact, rtol=2e-2, atol=2e-2)
    assert calls == ([1] if rows <= linear_mod.FEW_ROWS else [])


@needs_bf16
def test_engine_keeps_the_bf16_few_rows_copy_only_when_asked():
    from hybrid_engine import LLM, SamplingParams
    from hybrid_engine.config import EngineConfig
    outs = {}
    for keep in (True, False):
        llm = LLM(dtype="bfloat16", max_num_seqs=2, bf16_few_rows_copy=keep)
        assert hasattr(llm.engine.model.packed_lm_head, "few_rows") == keep
        outs[keep] = llm.generate(["def add(a, b):"], SamplingParams(temperature=0, max_tokens=4))[0]
    assert all(len(o.token_ids) == 4 for o in outs.values())
    with pytest.raises(ValueError, match="bf16_few_rows_copy must be a bool"):
        EngineConfig(bf16_few_rows_copy="yes").validate()


@needs_bf16
@pytest.mark.parametrize("few_rows_graph", [True, False])
def test_plain_bf16_weight_keeps_a_twin_for_compiled_few_rows_graphs(monkeypatch, few_rows_graph):
    """Compiled steps leave bf16 weights plain (inductor packs its own) with their blocked copy;
    a graph traced with `few_rows_graph` set calls the blocked op, one traced without calls
    the plain product. Both compute x W^T."""
    from torch import nn
    monkeypatch.setattr(linear_mod, "BLOCKED_MIN_BYTES", 0)
    m = nn.Module()
    m.a = nn.Linear(64, 48, bias=False).bfloat16()
    pack_weights(m, ["a.weight"], onednn=False)
    assert not m.a.weight.is_mkldnn and m.a.weight.few_rows.shape == (3, 32, 16, 2)
    targets = []

    def backend(gm, _inputs):
        targets.extend(node.target for node in gm.graph.nodes)
        return gm.forward
    torch._dynamo.reset()
    f = torch.compile(lambda x: linear(x, m.a.weight), backend=backend, dynamic=True)
    x = torch.randn(3, 64).bfloat16()
    monkeypatch.setattr(linear_mod, "few_rows_graph", few_rows_graph)
    y = f(x)
    assert (torch.ops.hybrid_engine_cpu.blocked_linear.default in targets) == few_rows_graph
    torch.testing.assert_close(y.float(), F.linear(x.float(), m.a.weight.float()), rtol=2e-2, atol=2e-2)


@needs_bf16
def test_compiled_steps_set_the_few_rows_flag_by_the_step_row_count():
    from hybrid_engine.compiled_steps import _tracing_config
    seen = []
    for rows in (1, linear_mod.FEW_ROWS, linear_mod.FEW_ROWS + 1):
        with _tracing_config(rows):
            seen.append(linear_mod.few_rows_graph)
    assert seen == [True, True, False] and linear_mod.few_rows_graph is False
