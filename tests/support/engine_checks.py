"""Checks every engine test makes after a run."""

from __future__ import annotations


def assert_no_leak(engine) -> None:
    """Nothing left running, every KV block and state slot back in the pools (cached blocks
    nobody holds count as free), and no prefix checkpoint still owned by a request."""
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.cache.num_free_slots == engine.cache.num_slots
    pool = engine.cache.prefix_store.checkpoints
    assert pool.num_pending == 0 and pool.num_free + len(pool.published()) == pool.size


def budget_for_blocks(engine, num_blocks: int) -> int:
    """A cache_memory_bytes that gives an engine configured as `engine` (max_num_seqs,
    speculation, prefix caching) exactly num_blocks KV blocks: its state slots (the pad slot
    included) and prefix checkpoints, plus the blocks."""
    u = engine.cache.usage()
    return u["state_bytes_total"] + u["checkpoint_bytes_total"] + num_blocks * engine.cache.spec.bytes_per_block


def assert_greedy_matches_transformers(llm, hf, lengths=(1, 9, 40), new_tokens: int = 24) -> None:
    """Greedy tokens of `llm` equal transformers' generate on `hf` for random prompts of
    `lengths` tokens (seed 0), `new_tokens` each."""
    import torch

    from hybrid_engine import SamplingParams
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, hf.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                              do_sample=False)
        assert out.token_ids == ref[0, len(prompt):].tolist(), f"prompt len {len(prompt)}"


def greedy_tokens(folder: str, dtype: str, **config) -> list[list[int]]:
    """The greedy tokens (20 each) of an LLM of the checkpoint at `folder`, built with `config`,
    for four random prompts of 3, 17, 50 and 8 tokens (seed 1)."""
    import torch

    from hybrid_engine import LLM, SamplingParams
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 50, 8)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    llm = LLM(model=folder, dtype=dtype, **config)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


# Two requests share a prefix of 3 blocks (of 4 tokens: a hit for the second, run after the
# first), one long prompt is prefilled in chunks (under a small max_num_batched_tokens), and a
# fourth prompt is short.
SHARED_PREFIX = [(7 * i + 3) % 200 + 1 for i in range(12)]
PREFIX_PROMPTS = [SHARED_PREFIX + [5, 6], SHARED_PREFIX + [9, 1, 4], [(5 * i) % 190 + 2 for i in range(37)], [11, 12]]


def run_alone_then_together(engine, prompts=PREFIX_PROMPTS, max_tokens: int = 10) -> list:
    """Each prompt after the one before has finished (so a shared prefix is a cache hit), then all
    of them at once, greedy: -> (token_ids, their logprobs, cached tokens) per request."""
    from hybrid_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    results = {}

    def drain():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out

    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"alone{i}")
        drain()
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"together{i}")
    drain()
    return [(results[rid].token_ids, [lp[t] for lp, t in zip(results[rid].logprobs, results[rid].token_ids)],
             results[rid].num_cached_tokens) for rid in sorted(results)]
