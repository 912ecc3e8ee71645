"""SamplingParams(n=...): n independent samples of one prompt from one prefill
(hybrid_engine/request_group.py), and the cache's fork verb that shares the prefill."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.request_group import sample_request_id
from hybrid_engine.state_cache import CacheSpec, HybridCacheManager

from engine_checks import assert_no_leak, budget_for_blocks

PROMPT = "def read_config(path):"
MTP2 = {"method": "mtp", "num_speculative_tokens": 2}


def sampled(n=4, seed=1, **overrides) -> SamplingParams:
    return SamplingParams(**({"n": n, "seed": seed, "temperature": 1.0, "max_tokens": 12,
                              "ignore_eos": True} | overrides))


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", max_num_seqs=8)       # the packaged default model (it has MTP)


def completions(out) -> list[list[int]]:
    assert [c.index for c in out.outputs] == list(range(len(out.outputs)))
    return [c.token_ids for c in out.outputs]


def count_prompt_tokens(engine) -> list[int]:
    """Wraps the target model's forward: prompt positions computed, summed over the run."""
    counted, forward = [0], engine.runner.forward

    def counting(inputs):
        for seg in inputs.segments:
            prompt_len = len(seg.request.prompt_token_ids)
            counted[0] += max(0, min(seg.start + seg.num_tokens, prompt_len) - seg.start)
        return forward(inputs)
    engine.runner.forward = counting
    return counted


def test_seeded_n_is_reproducible_and_each_sample_is_its_child_seed(llm):
    params = sampled()
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    again = LLM(dtype="float32", max_num_seqs=8).generate(PROMPT, sampled(), use_tqdm=False)[0]
    got = completions(out)
    assert len(got) == 4 and got == completions(again)
    assert len({tuple(t) for t in got}) > 1                    # independent samples, not one copied
    assert [c.text for c in out.outputs] == [c.text for c in again.outputs]
    # The flat fields are completion 0's.
    assert out.token_ids == got[0] and out.text == out.outputs[0].text
    assert out.finish_reason == out.outputs[0].finish_reason == "length"
    for i in range(4):
        alone = llm.generate(PROMPT, sampled(n=1, seed=params.child_seed(i)), use_tqdm=False)[0]
        assert alone.token_ids == got[i], i
    assert params.child_seed(1) == 2 and SamplingParams(seed=2**64 - 1).child_seed(1) == 0   # wrapped
    assert_no_leak(llm.engine)


def test_unseeded_n_follows_the_llm_seed():
    params = sampled(seed=None)
    a = LLM(dtype="float32", max_num_seqs=8, seed=7).generate(PROMPT, params, use_tqdm=False)[0]
    b = LLM(dtype="float32", max_num_seqs=8, seed=7).generate(PROMPT, params, use_tqdm=False)[0]
    assert completions(a) == completions(b) and len({tuple(t) for t in completions(a)}) > 1


@pytest.mark.parametrize("batched_tokens", [2048, 8], ids=["one_chunk", "chunked_prefill"])
def test_the_prompt_is_prefilled_once(batched_tokens):
    llm = LLM(dtype="float32", max_num_seqs=4, max_num_batched_tokens=batched_tokens)
    prompt_len = len(llm.engine.encode_prompt(PROMPT)[1])
    counted = count_prompt_tokens(llm.engine)
    out = llm.generate(PROMPT, sampled(), use_tqdm=False)[0]
    # The shared prefix once, then each sample's own last prompt token.
    assert counted[0] == prompt_len - 1 + 4
    reference = LLM(dtype="float32", max_num_seqs=4).generate(PROMPT, sampled(), use_tqdm=False)[0]
    assert completions(out) == completions(reference)
    assert_no_leak(llm.engine)


def test_with_prefix_caching_the_samples_share_the_prompts_full_blocks():
    prompt = list(range(3, 43))                         # 2 full blocks of 16 and 8 tokens
    runs = {}
    for on in (False, True):
        engine = LLM(dtype="float32", max_num_seqs=4, enable_prefix_caching=on).engine
        engine.add_request(prompt, sampled(), request_id="r")
        while sample_request_id("r", 1) not in engine.cache:
            engine.step()                               # sample 0: all but the last prompt token; then forked
        tables = [engine.cache.get(sample_request_id("r", i)).block_table for i in range(4)]
        assert len({t[2] for t in tables}) == 4         # the partial block: a copy each
        shared = {tuple(t[:2]) for t in tables}
        assert len(shared) == (1 if on else 4)
        assert engine.cache._blocks.ref_count(tables[0][0]) == (4 if on else 1)
        runs[on] = []
        while engine.has_unfinished_requests():
            runs[on] += [o for o in engine.step() if o.finished]
        assert_no_leak(engine)
    assert completions(runs[True][0]) == completions(runs[False][0])


def test_greedy_n_gives_n_copies_of_the_greedy_output(llm):
    greedy = dict(temperature=0.0, seed=None, ignore_eos=False)
    out = llm.generate(PROMPT, sampled(n=3, **greedy), use_tqdm=False)[0]
    one = llm.generate(PROMPT, sampled(n=1, **greedy), use_tqdm=False)[0]
    assert completions(out) == [one.token_ids] * 3
    assert [c.text for c in out.outputs] == [one.text] * 3
    assert_no_leak(llm.engine)


def test_n_with_mtp_speculation_equals_n_without(llm):
    spec = LLM(dtype="float32", max_num_seqs=8, speculative_config=MTP2)
    prompts = [PROMPT, "import os\n", [5]]        # a one-token prompt has no prefix to share
    params = [sampled(), sampled(n=3, seed=9, top_p=0.9), sampled(n=2, temperature=0.0, seed=None)]
    plain = llm.generate(prompts, params, use_tqdm=False)
    fast = spec.generate(prompts, params, use_tqdm=False)
    assert [completions(o) for o in fast] == [completions(o) for o in plain]
    assert spec.engine.spec_stats.num_accepted > 0
    assert_no_leak(spec.engine)


def test_preemption_and_n_above_max_num_seqs_change_nothing(llm):
    prompts = [PROMPT, "class Config:\n    def", "import json\n"]
    params = [sampled(n=3, seed=s, max_tokens=28) for s in (1, 20, 40)]
    expected = [completions(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    # Two running at most, and 4 blocks of 16 tokens for two of ~36: samples wait for room and
    # get preempted.
    probe = LLM(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16).engine
    tight = LLM(dtype="float32", max_num_seqs=2, max_num_batched_tokens=16,
                cache_memory_bytes=budget_for_blocks(probe, 4))
    got = tight.generate(prompts, params, use_tqdm=False)
    assert [completions(o) for o in got] == expected
    assert tight.engine.num_preemptions > 0
    assert_no_leak(tight.engine)


def test_stream_deltas_carry_the_completion_index(llm):
    joined_ids, joined_text, final = {}, {}, None
    for out in llm.generate_stream(PROMPT, sampled(n=3, max_tokens=8)):
        for c in out.outputs:
            joined_ids.setdefault(c.index, []).extend(c.new_token_ids)
            joined_text[c.index] = joined_text.get(c.index, "") + c.new_text
        final = out
    assert final.finished and len(final.outputs) == 3
    assert [joined_ids[i] for i in range(3)] == completions(final)
    assert [joined_text[i] for i in range(3)] == [c.text for c in final.outputs]
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("steps", [0, 1, 3, 6])
def test_abort_of_the_request_id_aborts_every_sample(llm, steps):
    engine = llm.loop.run_on_loop(lambda e: e)        # the loop is idle: drive the engine here
    rid = engine.add_request(PROMPT, sampled(n=4, max_tokens=50))
    for _ in range(steps):
        engine.step()
    out = engine.abort_request(rid)
    assert out.request_id == rid and out.finished and len(out.outputs) == 4
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert engine.abort_request(rid) is None and not engine.requests and not engine.groups
    assert_no_leak(engine)


def test_closing_a_stream_of_n_frees_everything(llm):
    stream = llm.generate_stream(PROMPT, sampled(n=4, max_tokens=200))
    next(stream)
    next(stream)
    stream.close()
    llm.loop.run_on_loop(lambda e: None)              # the abort has run by then
    assert_no_leak(llm.engine)


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "2", None])
def test_n_must_be_a_positive_int(llm, n):
    with pytest.raises(ValueError, match="^prompt 0: n must be an int >= 1, got"):
        llm.generate(PROMPT, SamplingParams(n=n), use_tqdm=False)


def test_an_id_one_of_n_samples_runs_under_is_refused(llm):
    engine = llm.loop.run_on_loop(lambda e: e)
    rid = engine.add_request(PROMPT, sampled(n=2), request_id="r")
    with pytest.raises(ValueError, match="request id 'r#sample1' ends in '#sample<number>'"):
        engine.add_request(PROMPT, sampled(n=2), request_id=sample_request_id("r", 1))
    with pytest.raises(ValueError, match="ends in '#sample<number>'"):
        llm.loop.submit(PROMPT, sampled(n=1), request_id="q#sample0")
    assert engine.abort_request(sample_request_id("r", 0)) is None   # a sample is not a request of its own
    engine.abort_request(rid)
    assert_no_leak(engine)


# -- the fork verb --------------------------------------------------------------------------

def tiny_cache(num_blocks=8, num_slots=6) -> HybridCacheManager:
    spec = CacheSpec(num_attention_layers=2, num_kv_heads=2, head_dim=4, block_size=4, kv_dtype=torch.float32,
                     num_gdn_layers=2, conv_dim=6, conv_kernel=4, num_v_heads=2, key_head_dim=3,
                     value_head_dim=5, conv_dtype=torch.float32)
    cache = HybridCacheManager(spec, num_blocks, num_slots)
    g = torch.Generator().manual_seed(0)
    for pool in (*cache.pools.kv_caches, *cache.pools.conv_states, *cache.pools.recurrent_states):
        pool.copy_(torch.randn(pool.shape, generator=g))
    return cache


def pools(cache: HybridCacheManager) -> list[torch.Tensor]:
    return [t.clone() for t in (*cache.pools.kv_caches, *cache.pools.conv_states, *cache.pools.recurrent_states)]


def test_fork_copies_the_committed_kv_and_state_into_memory_of_its_own():
    cache = tiny_cache()
    src = cache.allocate("a", 10, 1)
    cache.commit("a", 6)          # blocks 0..1 committed, block 2 only reserved
    dst = cache.fork("a", "b", 1)
    assert dst is not None
    assert len(dst.block_table) == 2 and dst.num_tokens == dst.num_committed_tokens == 6
    assert not set(dst.block_table) & set(src.block_table) and dst.slot not in (src.slot, *src.draft_slots)
    assert len(dst.draft_slots) == 1
    for kv in cache.pools.kv_caches:
        assert torch.equal(kv[dst.block_table], kv[src.block_table[:2]])
    for pool in (*cache.pools.conv_states, *cache.pools.recurrent_states):
        assert torch.equal(pool[dst.slot], pool[src.slot])
    cache.free("a")               # the copy stands alone
    assert cache.grow("b", 12)
    cache.free("b")
    assert cache.num_free_blocks == cache.num_blocks and cache.num_free_slots == cache.num_slots


@pytest.mark.parametrize("case", ["unknown_src", "dst_exists", "no_blocks", "no_slots", "no_room_to_grow",
                                  "negative_drafts"])
def test_a_refused_fork_changes_nothing(case):
    cache = tiny_cache(num_blocks=5, num_slots=4)
    cache.allocate("a", 8)
    cache.commit("a", 8)
    cache.allocate("c", 4)
    args, error = {
        "unknown_src": (("x", "b"), KeyError),
        "dst_exists": (("a", "c"), ValueError),
        "no_blocks": (("a", "b", 0), None),     # needs 2 blocks, 2 free: take one
        "no_slots": (("a", "b", 2), None),      # needs 3 slots, 2 free
        "no_room_to_grow": (("a", "b", 0, 13), None),   # needs 4 blocks to grow to 13 tokens, 3 free
        "negative_drafts": (("a", "b", -1), ValueError),
    }[case]
    if case == "no_blocks":
        cache.allocate("d", 4)
    before = (cache.usage(), {r: (list(cache.get(r).block_table), cache.get(r).slot) for r in "acd" if r in cache},
              pools(cache))
    if error is None:                   # no room: refused with None
        assert cache.fork(*args) is None
    else:
        with pytest.raises(error):
            cache.fork(*args)
    after = (cache.usage(), {r: (list(cache.get(r).block_table), cache.get(r).slot) for r in "acd" if r in cache},
             pools(cache))
    assert before[:2] == after[:2] and all(torch.equal(x, y) for x, y in zip(before[2], after[2]))
    assert "b" not in cache


def held(cache: HybridCacheManager, ids) -> dict:
    return {r: (tuple(c.block_table), c.slot, tuple(c.draft_slots), c.num_tokens, c.num_committed_tokens)
            for r in ids if r in cache for c in [cache.get(r)]}


OPS = st.lists(st.tuples(st.sampled_from(["allocate", "commit", "fork", "free"]), st.integers(0, 3),
                         st.integers(0, 3), st.integers(0, 14), st.integers(0, 2)), max_size=30)


@settings(max_examples=60, deadline=None)
@given(OPS)
def test_random_forks_keep_ownership_disjoint_and_copy_exactly(ops):
    cache, ids = tiny_cache(num_blocks=8, num_slots=6), range(4)
    for op, a, b, tokens, drafts in ops:
        before, tensors = held(cache, ids), pools(cache)
        done = True
        try:
            if op == "allocate":
                done = cache.allocate(a, tokens, drafts) is not None
            elif op == "commit":
                cache.commit(a, min(tokens, cache.get(a).num_tokens) if a in cache else tokens)
            elif op == "fork":
                done = cache.fork(a, b, drafts) is not None
            else:
                cache.free(a)
        except (KeyError, ValueError):
            done = False
        if not done:
            assert held(cache, ids) == before           # refused: nothing changed
            assert all(torch.equal(x, y) for x, y in zip(tensors, pools(cache)))
        elif op == "fork":
            src, dst = cache.get(a), cache.get(b)
            for kv in cache.pools.kv_caches:
                assert torch.equal(kv[dst.block_table], kv[src.block_table[:len(dst.block_table)]])
            for pool in (*cache.pools.conv_states, *cache.pools.recurrent_states):
                assert torch.equal(pool[dst.slot], pool[src.slot])
            assert dst.num_tokens == dst.num_committed_tokens == src.num_committed_tokens
        blocks = [blk for r in held(cache, ids).values() for blk in r[0]]
        slots = [s for r in held(cache, ids).values() for s in (r[1], *r[2])]
        assert len(set(blocks)) == len(blocks) == cache.num_blocks - cache.num_free_blocks
        assert len(set(slots)) == len(slots) == cache.num_slots - cache.num_free_slots
