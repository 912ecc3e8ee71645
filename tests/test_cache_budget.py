"""One cache budget: prefix checkpoints take what the requests leave (fewer, or none, with a
warning, where they used to refuse the budget), max_num_seqs derived from it when not given,
and the capacity reported at start-up."""

from __future__ import annotations

import logging

import pytest

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.cache_sizing import DEFAULT_MAX_NUM_SEQS, MAX_DERIVED_NUM_SEQS, derive_max_num_seqs
from hybrid_engine.state_cache import CheckpointPool

from engine_checks import assert_no_leak
from spec_models import make_spec_checkpoint

PROMPTS = ["def main():", "import os\nimport sys\n", "class Config:\n    def __init__(self, path):"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("budget"), "qwen3_5"))


def token_ids(llm, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_700_kb_budget_runs_the_default_model_with_prefix_caching_on():
    """The issue's configuration: its 4 requests' state slots and KV fit, 8 checkpoints (about
    28 KV blocks' worth each) do not. It used to be refused; now it runs without them, says
    so, and computes what a roomy engine computes."""
    with pytest.warns(UserWarning, match="keeps 0 of 8 GDN checkpoints.*repeated prompts are computed again"):
        tight = LLM(dtype="float32", block_size=4, max_num_seqs=4, cache_memory_bytes=700_000)
    assert tight.engine.prefix is not None and tight.engine.cache.prefix_store.checkpoints.size == 0
    assert tight.engine.cache.num_blocks == 28          # what it had before prefix caching was the default
    roomy = LLM(dtype="float32", block_size=4, max_num_seqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=16)
    for _ in range(2):                                  # the repeat finds cached blocks and no checkpoint
        assert token_ids(tight, PROMPTS, params) == token_ids(roomy, PROMPTS, params)
    assert_no_leak(tight.engine)


def test_a_budget_short_of_the_checkpoints_asked_keeps_the_ones_it_holds(ckpt):
    probe = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_seqs=2)).cache
    assert probe.prefix_store.checkpoints.size == 4
    per_checkpoint, per_block = CheckpointPool.bytes_per_checkpoint(probe.spec), probe.spec.bytes_per_block
    # Beside the requests' slots: a byte short of 3 checkpoints with a KV block each.
    budget = probe.usage()["state_bytes_total"] + 3 * (per_checkpoint + per_block) - 1
    with pytest.warns(UserWarning, match="keeps 2 of 4 GDN checkpoints.*fewer cached prefixes"):
        llm = LLM(model=ckpt, dtype="float32", max_num_seqs=2, cache_memory_bytes=budget)
    assert llm.engine.cache.prefix_store.checkpoints.size == 2
    assert llm.engine.cache.num_blocks == (3 * (per_checkpoint + per_block) - 1 - 2 * per_checkpoint) // per_block
    roomy = LLM(model=ckpt, dtype="float32")
    prompt = list(range(3, 23))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = token_ids(roomy, [prompt], params)
    assert token_ids(llm, [prompt], params) == expected
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again.token_ids == expected[0] and again.num_cached_tokens == 16
    assert_no_leak(llm.engine)


def test_max_num_seqs_is_derived_from_the_budget_and_reported(ckpt, caplog):
    probe = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_seqs=1)).cache
    spec = probe.spec
    # A sequence's share: its state slot, 4096 tokens of KV (the model's max_position_embeddings
    # is 4096 too) and its 2 prefix checkpoints; the pad slot belongs to none.
    per_seq = spec.bytes_per_slot + 4096 // 16 * spec.bytes_per_block + 2 * CheckpointPool.bytes_per_checkpoint(spec)
    budget = 5 * per_seq + spec.bytes_per_slot + per_seq - 1
    with caplog.at_level(logging.INFO, logger="hybrid_engine.engine"):
        engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", cache_memory_bytes=budget))
    assert engine.config.max_num_seqs == engine.scheduler.max_num_seqs == engine.cache.num_slots == 5
    assert engine.cache.prefix_store.checkpoints.size == 10
    kv_tokens = engine.cache.num_blocks * 16
    assert kv_tokens >= 5 * 4096
    summary = engine.capacity_summary()
    assert summary == (f"KV cache: {engine.cache.num_blocks} blocks of 16 tokens ({kv_tokens} tokens); "
                       f"max_num_seqs 5 (derived from cache_memory_bytes); maximum concurrency 5.00 for 4096 "
                       f"tokens per request; 10 prefix checkpoints")
    assert [r.getMessage() for r in caplog.records if r.name == "hybrid_engine.engine"] == [summary]
    # Through LLM, whose default is now "derive" too; a given max_num_seqs is kept.
    assert LLM(model=ckpt, dtype="float32", cache_memory_bytes=budget).engine.config.max_num_seqs == 5
    given = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_seqs=3, cache_memory_bytes=budget))
    assert given.config.max_num_seqs == 3 and "max_num_seqs 3;" in given.capacity_summary()


def test_without_a_budget_max_num_seqs_stays_64_within_the_batched_tokens(ckpt):
    assert LLMEngine(EngineConfig(model=ckpt, dtype="float32")).config.max_num_seqs == DEFAULT_MAX_NUM_SEQS == 64
    # A verify step of every running request must fit max_num_batched_tokens: 32 // (1 + 2).
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_batched_tokens=32,
                                    speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    assert engine.config.max_num_seqs == 10


def test_derive_max_num_seqs_bounds():
    assert derive_max_num_seqs(10**12, 10**6, 0, per_seq=1000, shared=0) == MAX_DERIVED_NUM_SEQS == 256
    assert derive_max_num_seqs(999, 2048, 0, per_seq=1000, shared=0) == 1     # from_budget then says too small
    assert derive_max_num_seqs(10_500, 2048, 0, per_seq=1000, shared=500) == 10
    assert derive_max_num_seqs(10**12, 100, 3, per_seq=1000, shared=0) == 25
    assert derive_max_num_seqs(None, 2048, 1, per_seq=1000, shared=0) == 64
