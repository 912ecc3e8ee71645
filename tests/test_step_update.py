"""The update half of a step: preemption without thrash, KV blocks kept across verify steps,
drafts handed over through the step's output."""

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.request import Request, RequestStatus
from hybrid_engine.scheduler import Scheduler
from hybrid_engine.state_cache import CacheSpec, HybridCacheManager

from spec_models import make_spec_checkpoint
from engine_checks import assert_no_leak


def tiny_cache(num_blocks: int, num_slots: int) -> HybridCacheManager:
    spec = CacheSpec(num_attention_layers=1, num_kv_heads=1, head_dim=2, block_size=4, kv_dtype=torch.float32,
                     num_gdn_layers=1, conv_dim=2, conv_kernel=2, num_v_heads=1, key_head_dim=2,
                     value_head_dim=2, conv_dtype=torch.float32)
    return HybridCacheManager(spec, num_blocks, num_slots)


def request(rid: str, num_prompt: int) -> Request:
    return Request(rid, None, [1] * num_prompt, SamplingParams(max_tokens=8), [0])


def test_a_preempted_request_is_not_readmitted_by_the_same_schedule_call():
    cache = tiny_cache(num_blocks=3, num_slots=2)
    sched = Scheduler(cache, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = request("a", 4), request("b", 8)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert [r for r, _ in first.prefills] == [a, b] and cache.num_free_blocks == 0
    for req in (a, b):          # both prefilled and sampled one token
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(2)
    # a's decode needs a 5th token (a new block): b, the newest, is preempted. The 1-token
    # budget left would let b back in at once with one block, only to be preempted again.
    sched.max_num_batched_tokens = 2
    second = sched.schedule()
    assert second.decodes == [a] and second.preempted == [b] and second.prefills == []
    assert b.status == RequestStatus.WAITING and list(sched.waiting) == [b] and "b" not in cache
    third = sched.schedule()               # the next call may admit it
    assert [r for r, _ in third.prefills] == [b]


@pytest.fixture(scope="module")
def spec_ckpt(tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp("spec"), "qwen3_5", embed_scale=1.6)


def test_verify_steps_keep_their_kv_blocks_and_drafts_come_from_the_step_output(spec_ckpt):
    engine = LLMEngine(EngineConfig(model=str(spec_ckpt), dtype="float32", block_size=4,
                                    speculative_config={"method": "mtp", "num_speculative_tokens": 3}))
    freed, outputs = [], []
    blocks = engine.cache._blocks
    real_free, real_update = blocks.free, engine.updater.update

    def counting_free(ids):
        ids = list(ids)
        freed.append(ids)
        real_free(ids)

    def recording_update(step_output):
        outputs.append(step_output)
        return real_update(step_output)

    blocks.free, engine.updater.update = counting_free, recording_update
    rid = engine.add_request(list(range(1, 10)), SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    req, tables = engine.requests[rid], []
    while engine.has_unfinished_requests():
        engine.step()
        if rid in engine.cache:
            # The drafts the request will verify are exactly the ones the step's output carried
            # (none after a prefill chunk that did not sample: prefix caching ends one at the
            # prompt's last block boundary).
            assert req.draft_token_ids == outputs[-1].drafts.get(rid, [])
            assert engine.cache.get(rid).num_committed_tokens == req.num_computed_tokens
            tables.append(list(engine.cache.get(rid).block_table))
    assert req.spec_stats.num_accepted < req.spec_stats.num_drafted and len(tables) > 5
    # Every step's block table extends the last one: rejected drafts gave no block back.
    for before, after in zip(tables, tables[1:]):
        assert after[:len(before)] == before
    assert len(freed) == 1              # only when the request finished
    assert_no_leak(engine)
