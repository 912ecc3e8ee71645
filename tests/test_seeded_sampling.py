"""Seeded sampling is reproducible token for token, whatever runs it: alone or in a batch of 16,
with chunked prefill, after preemption, and with MTP speculation at any k (the randomness of
output position p is keyed by (seed, p), hybrid_engine/sampler.py)."""

import random

import pytest

from hybrid_engine import LLM, SamplingParams

from engine_checks import assert_no_leak, budget_for_blocks
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")

SAMPLERS = [dict(temperature=1.0),
            dict(temperature=0.8, top_k=8, top_p=0.9),
            dict(temperature=1.2, min_p=0.1),
            dict(temperature=0.9, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.3, presence_penalty=0.2)]


@pytest.fixture(scope="module")
def spec_ckpts(tmp_path_factory):
    return {f: make_spec_checkpoint(tmp_path_factory.mktemp(f), f, embed_scale=1.6) for f in FAMILIES}


def workload(n=16):
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    params = [SamplingParams(seed=100 + i, max_tokens=rng.randint(8, 14), ignore_eos=True,
                             logprobs=1 if i % 5 == 0 else None, **SAMPLERS[i % len(SAMPLERS)])
              for i in range(n)]
    return prompts, params


def generate(folder, prompts, params, **engine_args):
    llm = LLM(model=str(folder), dtype="float32", max_num_seqs=16, **engine_args)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert_no_leak(llm.engine)
    return [o.token_ids for o in outs], llm.engine


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_output_is_the_same_however_it_runs(spec_ckpts, family):
    folder = spec_ckpts[family]
    prompts, params = workload()
    batch16, _ = generate(folder, prompts, params)
    assert len({tuple(t) for t in batch16}) == len(batch16)          # actually sampled
    for i in range(len(SAMPLERS)):                                   # one request of each sampler alone
        assert generate(folder, prompts[i], params[i])[0] == [batch16[i]], ("alone", i)
    assert generate(folder, prompts, params, max_num_batched_tokens=16)[0] == batch16, "chunked prefill"
    probe = LLM(model=str(folder), dtype="float32", max_num_seqs=16).engine
    tight = budget_for_blocks(probe, 24)                             # ~35 blocks needed at once
    got, engine = generate(folder, prompts, params, max_num_batched_tokens=64, cache_memory_bytes=tight)
    assert got == batch16 and engine.num_preemptions > 0, "preemption"
    for k in (1, 2, 4):
        got, engine = generate(folder, prompts, params, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        assert got == batch16, ("speculative", k)
        assert 0 < engine.spec_stats.num_accepted < engine.spec_stats.num_drafted
