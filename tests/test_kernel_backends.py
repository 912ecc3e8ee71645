"""The `cpu` kernel backend (native kernels) gives the `torch` reference's results: the same
requests through whole engines on each backend, for all three families, with MTP k=2, prefix
hits and chunked prefill, in float32. And the backend is the engine's own, chosen once."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine
from hybrid_engine.kernels import make_backend
from hybrid_engine.kernels.backends import native_cpu_available

from engine_checks import run_alone_then_together
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

needs_native = pytest.mark.skipif(not native_cpu_available(), reason="no native kernels at this CPU level")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6))


def _engine(ckpt: str, backend: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=ckpt, dtype="float32", block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=24, kernel_backend=backend,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 2}))




@needs_native
def test_cpu_backend_matches_the_torch_reference(ckpt):
    reference, native = _engine(ckpt, "torch"), _engine(ckpt, "cpu")
    # The native paths are really taken: decode and verify attention read the cache in place,
    # prefill GDN runs through the decode kernel (the torch engine does neither).
    assert native.builder.keyless_query_lens == frozenset({1, 2, 3}) and native.builder.recurrent_prefill
    assert not reference.builder.keyless_query_lens and not reference.builder.recurrent_prefill
    want, got = run_alone_then_together(reference), run_alone_then_together(native)
    assert any(cached for _, _, cached in want), "the shared prefix never hit"
    for (w_ids, w_lp, w_cached), (g_ids, g_lp, g_cached) in zip(want, got):
        assert g_ids == w_ids and g_cached == w_cached
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp),
                                   atol=1e-4, rtol=0)


def test_the_torch_backend_calls_no_native_code(ckpt, monkeypatch):
    """Every native kernel is a torch op of the hybrid_engine_cpu namespace: a torch-backend
    engine, weights and steps, never reaches one."""
    from hybrid_engine.kernels.native import ops as native_ops_module
    engine = _engine(ckpt, "torch")
    assert all(not type(p).__name__.endswith("Projection") for p in vars(engine.model).values())
    monkeypatch.setattr(native_ops_module, "native_ops", lambda level=None: pytest.fail("native code reached"))
    calls = []
    original = torch._ops.OpOverload.__call__

    def record(op, *args, **kwargs):
        if op.namespace.startswith("hybrid_engine_cpu"):
            calls.append(op.name())
        return original(op, *args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", record)
    run_alone_then_together(engine)
    assert calls == []


def test_backend_names_are_checked():
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="gpu").validate()
    with pytest.raises(ValueError, match="CPU tensors only"):
        make_backend("cpu", "cuda")
    assert make_backend("torch", "cpu").name == "torch"
