"""Decode/verify steps through CudaGraphSteps' padded buffers (the CUDA-graph path) on CPU: the
same tokens as plain eager steps, padding rows that write nothing and hold their pad values
at every run (never stale rows of a larger batch), and the buckets and the eager fallback
actually used. (Capture itself needs CUDA: tests/triton.)"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.cuda_graph_steps import CudaGraphSteps, default_buckets

from spec_models import make_spec_checkpoint
from staggered import run_staggered, staggered_workload

BUCKETS = [2, 4]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("graphs"), "qwen3_5", embed_scale=1.6))


def _engine(ckpt, k, graphs: bool):
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_seqs=6, block_size=4,
                                    max_num_batched_tokens=64, speculative_config=spec))
    if graphs:
        engine.runner.execution = CudaGraphSteps(engine.model, engine.cache.pools, engine.builder, [1, 1 + k], BUCKETS,
                                                 capture=False)
    return engine


class _Checked:
    """Wraps CudaGraphSteps._step (the padded forward): records (tokens per request, batch,
    bucket) and checks that a padded step changed only the real rows' KV slots and GDN write
    slots, and that its padding rows hold their pad values."""

    def __init__(self, graphs: CudaGraphSteps, cache):
        self.graphs, self.cache, self.seen = graphs, cache, []
        self.forward, self.step = graphs.forward, graphs._step
        graphs.forward, graphs._step = self, self._padded

    def __call__(self, inputs):
        self.inputs = inputs
        return self.forward(inputs)

    def _padded(self, L, bucket):
        b, n, buf = self.inputs.batch, self.inputs.batch.num_decodes, self.graphs.builder
        self.seen.append((L, n, bucket))
        pads = {"input_ids": (buf.input_ids[L * n:L * bucket], 0), "positions": (buf.positions[L * n:L * bucket], 0),
                "slot_mapping": (buf.slot_mapping[L * n:L * bucket], -1), "seq_lens": (buf.seq_lens[n:bucket], L),
                "block_tables": (buf.block_tables[n:bucket], 0),
                "state_slots": (buf.state_slots[n:bucket], self.cache.pad_slot),
                "state_write_slots": (buf.state_write_slots[n:bucket, :L], -1)}
        for name, (rows, value) in pads.items():
            assert bool((rows == value).all()), f"padding rows of {name} hold {rows.tolist()}"
        assert buf.cu_seqlens[:bucket + 1].tolist() == [L * i for i in range(bucket + 1)]
        kv = [t.clone() for t in self.cache.kv_caches]
        states = [t.clone() for t in self.cache.conv_states + self.cache.recurrent_states]
        out = self.step(L, bucket)
        written = set(b.state_write_slots.flatten().tolist())
        for before, after in zip(states, self.cache.conv_states + self.cache.recurrent_states):
            changed = (before != after).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= written, f"a padded step wrote GDN slots {set(changed) - written}"
            assert torch.equal(before[self.cache.pad_slot], after[self.cache.pad_slot])
        kv_slots = set(b.slot_mapping.tolist())
        for before, after in zip(kv, self.cache.kv_caches):
            changed = (before != after).any(-1).any(-1).any(1)              # [blocks, block_size]
            flat = changed.flatten().nonzero().flatten().tolist()
            assert set(flat) <= kv_slots, f"a padded step wrote KV slots {set(flat) - kv_slots}"
        return out


@pytest.mark.parametrize("k", [0, 2])
def test_padded_graph_steps_match_eager_tokens(ckpt, k):
    prompts, params, arrivals = staggered_workload()
    reference = [o.token_ids for o in run_staggered(_engine(ckpt, k, graphs=False), prompts, params, arrivals)]
    engine = _engine(ckpt, k, graphs=True)
    checked = _Checked(engine.runner.execution, engine.cache.pools)
    assert [o.token_ids for o in run_staggered(engine, prompts, params, arrivals)] == reference
    used = {(L, bucket) for L, _, bucket in checked.seen}
    assert (1 + k, 2) in used and (1 + k, 4) in used
    assert any(n < bucket for _, n, bucket in checked.seen if bucket), "no step was padded"
    assert engine.cache.num_free_slots == engine.cache.num_slots
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_steps_outside_the_buckets_run_eagerly(ckpt):
    engine = _engine(ckpt, 0, graphs=True)
    checked = _Checked(engine.runner.execution, engine.cache.pools)
    for i in range(6):                                  # 6 decodes > the largest bucket (4)
        engine.add_request([i + 1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    engine.step()                                       # prefill: eager
    engine.step()                                       # 6 decodes: eager
    assert checked.seen == []
    engine.abort_request("0"), engine.abort_request("1")
    engine.step()                                       # 4 decodes: bucket 4
    assert checked.seen == [(1, 4, 4)]


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert default_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_graph_options_are_validated():
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        EngineConfig(max_num_seqs=4, cuda_graph_batch_sizes=[8]).validate()
    with pytest.raises(ValueError, match="enforce_eager"):
        EngineConfig(enforce_eager="yes").validate()
