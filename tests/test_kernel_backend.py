"""An engine's kernel backend is chosen once, when the engine is made, and travels with every
step's ForwardBatch: changing the default mode afterwards changes nothing for it."""

from __future__ import annotations

import pytest

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams, kernels

from spec_models import make_spec_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("backend"), "qwen3_5", embed_scale=1.6))


def _generate(engine):
    for prompt in ([5, 17, 3, 99], [1, 2, 3, 4, 5, 6, 7]):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o.token_ids
    return [outs[rid] for rid in sorted(outs)]


def test_the_backend_is_fixed_at_construction(ckpt, monkeypatch):
    def make():
        return LLMEngine(EngineConfig(model=ckpt, dtype="float32", block_size=4, max_num_seqs=4,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": 2}))

    with kernels.using_backend("torch"):
        reference = _generate(make())
        engine = make()
    assert engine.builder.kernels.name == "torch"
    # Were any op of a step looked up by the default mode now, it would fail here.
    monkeypatch.setattr(kernels.dispatch, "_triton_backend", lambda: pytest.fail("a step asked the default mode"))
    with kernels.using_backend("triton"):
        assert _generate(engine) == reference
