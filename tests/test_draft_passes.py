"""spec_decode/draft_passes.py: a step's drafting as one call (the catch-up pass, then k-1
passes whose metadata is derived in torch) proposes the drafts, and writes the MTP KV, of
drafting pass by pass with every pass packed on the host (DraftInputBuilder.build)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams

from spec_models import make_spec_checkpoint
from staggered import run_staggered

K = 3
BLOCK_SIZE = 4      # drafts cross block boundaries often


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("drafts"), "qwen3_5", embed_scale=1.6))


def per_pass_drafts(engine, catchups) -> dict[str, list[int]]:
    """The reference: each pass packed by the builder from host lists, one pass at a time."""
    model, cache, builder = engine.model, engine.cache, engine.runner.drafts

    def packed(segs, tokens, hidden):
        return builder.build(segs, tokens.tolist(), hidden, [], 0).batch

    table = {c.request_id: cache.get(c.request_id).block_table for c in catchups}
    segs = [(c.start, len(c.next_tokens), table[c.request_id]) for c in catchups]
    tokens = torch.tensor([t for c in catchups for t in c.next_tokens])
    hidden = torch.cat([c.hidden for c in catchups])
    h = model.mtp_forward(tokens, hidden, packed(segs, tokens, hidden), cache.pools)
    drafting = [i for i, c in enumerate(catchups) if c.draft]
    if not drafting:
        return {}
    ends = torch.tensor([n for _, n, _ in segs]).cumsum(0) - 1
    h = h[ends[drafting]]
    draft = model.compute_logits(h).max(dim=-1).indices
    drafts = [draft]
    last = [catchups[i].start + len(catchups[i].next_tokens) - 1 for i in drafting]
    for j in range(1, K):
        batch = packed([(p + j, 1, table[catchups[i].request_id]) for i, p in zip(drafting, last)], draft, h)
        h = model.mtp_forward(draft, h, batch, cache.pools)
        draft = model.compute_logits(h).max(dim=-1).indices
        drafts.append(draft)
    return dict(zip([catchups[i].request_id for i in drafting], torch.stack(drafts, 1).tolist()))


@pytest.mark.parametrize("keys", [False, True], ids=["as-chosen", "with-keys"])
def test_one_call_drafting_equals_pass_by_pass(ckpt, keys):
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", block_size=BLOCK_SIZE, max_num_seqs=4,
                                    max_num_batched_tokens=64,
                                    speculative_config={"method": "mtp", "num_speculative_tokens": K}))
    drafter = engine.drafter
    if keys:     # the draft passes' attention made with PagedKeys, as where no native kernel serves them
        engine.runner.drafts.keyless_query_lens = frozenset()
        engine.runner.passes = dataclasses.replace(engine.runner.passes, keyless=False)
    run, mtp_kv = drafter.run, engine.cache.pools.kv_caches[-1]
    seen = {"calls": 0, "batched": 0, "subset": 0, "new_block": 0}

    def checked(catchups):
        before = mtp_kv.clone()
        with torch.inference_mode():
            want = per_pass_drafts(engine, catchups)
        want_kv = mtp_kv.clone()
        mtp_kv.copy_(before)
        got = run(catchups)
        assert got == want
        torch.testing.assert_close(mtp_kv, want_kv, rtol=0, atol=0, equal_nan=True)
        drafting = [c for c in catchups if c.draft]
        seen["calls"] += bool(drafting)
        seen["batched"] += len(drafting) > 1
        seen["subset"] += 0 < len(drafting) < len(catchups)
        seen["new_block"] += any((c.start + len(c.next_tokens) - 1 + j) % BLOCK_SIZE == 0
                                 for c in drafting for j in range(1, K))
        return got

    drafter.run = checked
    prompts = [[(7 * i + 3 * j) % 256 for j in range(n)] for i, n in enumerate((1, 5, 9, 30, 3, 14))]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 20, 3, 16, 7, 25)]
    run_staggered(engine, prompts, params, [0, 0, 1, 2, 4, 4])
    assert seen["calls"] > 10 and seen["batched"] and seen["subset"] and seen["new_block"], seen
