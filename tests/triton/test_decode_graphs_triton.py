"""The CUDA-graph decode path on the triton backend: padded bucketed steps (captured on a GPU,
run eagerly over the same buffers under the interpreter) give the torch backend's tokens,
and a decode/verify step reads nothing back to the host, which capture requires."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.cuda_graph_steps import CudaGraphSteps
from hybrid_engine.kernels.attention import triton as triton_attention
from hybrid_engine.kernels.triton_support import common as triton_common

PROMPTS = [[5, 17, 3, 99, 250, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42, 7]]
MAX_TOKENS = [5, 3, 4]                 # finishing at different steps: batches of 3, 2 and 1
# aten ops that copy a device value to the host (or size an output by one)
HOST_READS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "unique", "_unique2",
              "masked_select", "tolist"}


def _engine(device, k, graphs, backend="triton"):
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    engine = LLMEngine(EngineConfig(dtype="float32", device=device, block_size=4, max_num_seqs=4,
                                    speculative_config=spec, enforce_eager=True, kernel_backend=backend))
    if graphs:
        engine.runner.execution = graphs = CudaGraphSteps(engine.model, engine.cache.pools, engine.builder, [1, 1 + k],
                                                          [2, 4], capture=device == "cuda")
        with torch.inference_mode():
            graphs.capture()
    return engine


def _generate(engine):
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o.token_ids
    return [outs[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("k", [0, 2], ids=["plain", "mtp2"])
def test_graph_path_on_triton_matches_torch(device, k):
    ref = _generate(_engine(device, k, graphs=False, backend="torch"))
    engine = _engine(device, k, graphs=True)
    runs = []
    graphs = engine.runner.execution
    forward = graphs.forward
    graphs.forward = lambda inputs: (runs.append(inputs.batch.num_decodes) if not inputs.batch.num_prefills
                                     else None) or forward(inputs)
    out = _generate(engine)
    assert out == ref
    assert any(b in (1, 3) for b in runs), f"no padded step among batch sizes {runs}"
    if device == "cuda":
        assert sorted(bucket for L, bucket in graphs.graphs if L == 1) == [2, 4]


class _HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_READS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("k", [0, 2], ids=["decode", "verify"])
def test_graphed_step_reads_nothing_back_to_the_host(device, k, monkeypatch):
    # The kernels' host-side precondition checks sync, so they are off on a GPU (unless
    # HYBRID_ENGINE_KERNEL_CHECKS=1); switch them off here too, on any device.
    monkeypatch.setattr(triton_common, "checks_enabled", lambda x: False)
    monkeypatch.setattr(triton_attention, "checks_enabled", lambda x: False)
    engine = _engine(device, k, graphs=True)
    graphs = engine.runner.execution
    for prompt in PROMPTS:
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()                                            # prefill (eager)
    if k:
        engine.step()                                        # a first verify fills the buffers
    graphs._pad(1 + k, 4, 0)                                 # what capture runs on: all padding
    with torch.inference_mode(), _HostReads() as reads:
        graphs._step(1 + k, 4)
    assert reads.ops == [], f"host reads in a graphed step: {reads.ops}"
