"""One tiny generation on the triton backend matches the torch backend token for token.

Exercises the glue the op tests do not: the model's layouts and strided views, cu_seqlens,
state and draft slots, block tables, over a prefill and decode steps (and MTP verify steps,
whose rows carry k+1 tokens).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.kernels.backends import OP_NAMES, TRITON_FORMS

PROMPTS = [[5, 17, 3, 99, 250, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("hybrid-engine-cache")


def _generate(backend, spec, device, cache_dir, monkeypatch):
    # The engine's build cache (kernels/native/build.py): this test's own, not the user's.
    monkeypatch.setenv("HYBRID_ENGINE_CACHE_DIR", str(cache_dir))
    llm = LLM(dtype="float32", device=device, block_size=4, speculative_config=spec, kernel_backend=backend)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("spec", [None, {"method": "mtp", "num_speculative_tokens": 2}], ids=["plain", "mtp2"])
def test_triton_generation_matches_torch(device, spec, model_cache, monkeypatch):
    torch.manual_seed(0)
    ref = _generate("torch", spec, device, model_cache, monkeypatch)
    calls = _count_triton_calls(monkeypatch)
    out = _generate("triton", spec, device, model_cache, monkeypatch)
    assert all(len(t) == 5 for t in ref)
    assert out == ref
    # gdn_decode: the layer's decode step, this backend's conv update and recurrent kernels inside
    used = {"chunk_gated_delta_rule", "gdn_decode", "causal_conv1d_varlen", "paged_attention", "write_kv_cache",
            "rms_norm", "gated_rms_norm", "qk_norm_rope"}
    assert used <= set(calls), f"ops that never ran on triton: {sorted(used - set(calls))}"


def _count_triton_calls(monkeypatch) -> dict[str, int]:
    calls: dict[str, int] = {}
    for path in TRITON_FORMS:
        module = importlib.import_module(f"hybrid_engine.kernels.{path}")
        for name in filter(lambda name: hasattr(module, name), OP_NAMES):
            def counted(*args, _op=getattr(module, name), _name=name, **kwargs):
                calls[_name] = calls.get(_name, 0) + 1
                return _op(*args, **kwargs)
            monkeypatch.setattr(module, name, counted)
    return calls
