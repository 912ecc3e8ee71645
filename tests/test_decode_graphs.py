"""Decode/verify steps through DecodeGraphs' persistent, padded buffers (CUDA-graph path) on
CPU: the same tokens as plain eager steps, padding rows that write nothing, and the buckets
and the eager fallback actually used. (Capture itself needs CUDA: tests/triton.)"""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.decode_graphs import DecodeGraphs, default_buckets
from hybrid_engine.model_runner import ModelRunner

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
        engine.runner = ModelRunner(engine.model, engine.cache, DecodeGraphs(
            engine.model, engine.cache, engine.builder, [1, 1 + k], BUCKETS, capture=False))
    return engine


class _Checked:
    """Wraps DecodeGraphs.run: records (tokens per request, batch, bucket) and checks that a
    padded step changed only the real rows' KV slots and GDN write slots."""

    def __init__(self, graphs: DecodeGraphs, cache):
        self.graphs, self.cache, self.seen = graphs, cache, []
        self.run = graphs.run
        graphs.run = self

    def __call__(self, inputs):
        b = inputs.batch
        bucket = self.graphs.graphs[b.decode_len].bucket_for(b.num_decodes)
        self.seen.append((b.decode_len, b.num_decodes, bucket))
        kv = [t.clone() for t in self.cache.pools.kv_caches]
        states = [t.clone() for t in self.cache.pools.conv_states + self.cache.pools.recurrent_states]
        out = self.run(inputs)
        written = set(b.state_write_slots.flatten().tolist())
        for before, after in zip(states, self.cache.pools.conv_states + self.cache.pools.recurrent_states):
            changed = (before != after).flatten(1).any(1).nonzero().flatten().tolist()
            assert set(changed) <= written, f"a padded step wrote GDN slots {set(changed) - written}"
            assert torch.equal(before[self.cache.pools.pad_slot], after[self.cache.pools.pad_slot])
        kv_slots = set(b.slot_mapping.tolist())
        for before, after in zip(kv, self.cache.pools.kv_caches):
            changed = (before != after).any(-1).any(-1).any(1)              # [blocks, block_size]
            flat = changed.flatten().nonzero().flatten().tolist()
            assert set(flat) <= kv_slots, f"a padded step wrote KV slots {set(flat) - kv_slots}"
        return out


@pytest.mark.parametrize("k", [0, 2])
def test_padded_graph_steps_match_eager_tokens(ckpt, k):
    prompts, params, arrivals = staggered_workload()
    reference = [o.token_ids for o in run_staggered(_engine(ckpt, k, graphs=False), prompts, params, arrivals)]
    engine = _engine(ckpt, k, graphs=True)
    checked = _Checked(engine.runner.decode_graphs, engine.cache)
    assert [o.token_ids for o in run_staggered(engine, prompts, params, arrivals)] == reference
    used = {(L, bucket) for L, _, bucket in checked.seen}
    assert (1 + k, 2) in used and (1 + k, 4) in used
    assert any(n < bucket for _, n, bucket in checked.seen if bucket), "no step was padded"
    assert engine.cache.num_free_slots == engine.cache.num_slots
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_steps_outside_the_buckets_run_eagerly(ckpt):
    engine = _engine(ckpt, 0, graphs=True)
    checked = _Checked(engine.runner.decode_graphs, engine.cache)
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
