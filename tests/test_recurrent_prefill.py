"""Prefill segments run by the GDN decode kernel token by token (ForwardBatch.recurrent_prefill,
where kernels.decode_kernel_serves_prefill: the native CPU kernel) instead of the chunked form:
the builder's pieces cover each segment exactly, split at its checkpoint captures, and the engine
gives the chunked form's tokens, logprobs and checkpoints (to float32 rounding)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.kernels.gdn.decode_cpu import native_available
from hybrid_engine.step_inputs import Segment, StepInputBuilder

from spec_models import make_spec_checkpoint


@st.composite
def prefill_segments(draw):
    """Prefill segments packed one after another, each with ascending capture positions inside
    (start, start + n] and a state slot of its own."""
    segs, row = [], 0
    for i in range(draw(st.integers(1, 4))):
        start = draw(st.sampled_from([0, 16, 40]))
        n = draw(st.integers(1, 70))
        cuts = sorted(draw(st.sets(st.integers(start + 1, start + n), max_size=3)))
        req = SimpleNamespace(request_id=str(i))
        segs.append((Segment(req, start, n, row, False, True, [(p, 7 + j) for j, p in enumerate(cuts)]), 10 + i))
        row += n
    return segs


@settings(max_examples=60, deadline=None)
@given(prefill_segments())
def test_pieces_cover_each_segment_split_at_its_captures(segs):
    builder = StepInputBuilder(512, 8, 16, 16, recurrent_prefill=True)
    slots = {seg.request.request_id: SimpleNamespace(slot=slot) for seg, slot in segs}
    rp = builder._recurrent_prefill([seg for seg, _ in segs], SimpleNamespace(get=slots.__getitem__))
    pieces, capture = list(rp.pieces), 0
    for seg, slot in segs:
        bounds = [0] + [p - seg.start for p, _ in seg.captures]
        if bounds[-1] < seg.num_tokens:
            bounds.append(seg.num_tokens)
        for lo, hi in zip(bounds, bounds[1:]):
            piece = pieces.pop(0)
            assert (piece.first_row, piece.num_tokens) == (seg.first_row + lo, hi - lo)
            assert piece.read_slots.tolist() == [slot]
            assert piece.write_slots.tolist() == [[-1] * (hi - lo - 1) + [slot]]
            at_capture = seg.start + hi in [p for p, _ in seg.captures]
            assert piece.capture == (capture if at_capture else None)
            capture += at_capture
    assert not pieces
    fresh = [slot for seg, slot in segs if seg.start == 0]
    assert (rp.fresh_slots.tolist() if rp.fresh_slots is not None else []) == fresh


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("recurrent_prefill"), "qwen3_5", embed_scale=1.6))


def test_engine_uses_it_where_the_native_kernel_runs(ckpt):
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32"))
    assert engine.builder.recurrent_prefill == native_available()


@pytest.mark.parametrize("k", [0, 2])
def test_same_tokens_logprobs_and_checkpoints_as_the_chunked_form(ckpt, k):
    """Prompts longer and shorter than a chunk, prefilled in chunks of at most 100 tokens with
    several in one step (fresh segments and continued ones), checkpoints every 32 tokens and a
    prefix hit on a repeated prompt: the recurrent form's outputs and checkpoints against the
    chunked form's."""
    rng = random.Random(6)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (150, 77, 45, 9)]
    prompts.append(prompts[0][:120] + [rng.randrange(256) for _ in range(10)])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    runs = {}
    for recurrent in (True, False):
        engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_batched_tokens=100, max_num_seqs=4,
                                        speculative_config=spec, prefix_checkpoint_interval=32))
        engine.builder.recurrent_prefill = recurrent
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        outs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0]
        pool, pools = engine.cache.prefix_store.checkpoints, engine.cache.pools
        published = sorted(pool.published(), key=lambda c: (c.num_tokens, c.entry))
        entries = pools.checkpoint_conv_states + pools.checkpoint_recurrent_states
        runs[recurrent] = (outs, [(c.num_tokens, [t[c.entry].clone() for t in entries])
                                  for c in published])
        assert engine.prefix_cache_stats["hits"] >= 1
    (rec, rec_ck), (chunked, chunked_ck) = runs[True], runs[False]
    assert {i: o.token_ids for i, o in rec.items()} == {i: o.token_ids for i, o in chunked.items()}
    for i in rec:
        got = [lp[t] for lp, t in zip(rec[i].logprobs, rec[i].token_ids)]
        want = [lp[t] for lp, t in zip(chunked[i].logprobs, chunked[i].token_ids)]
        assert got == pytest.approx(want, abs=1e-4)
    assert [n for n, _ in rec_ck] == [n for n, _ in chunked_ck] and len(rec_ck) >= 6
    for (_, got), (_, want) in zip(rec_ck, chunked_ck):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
