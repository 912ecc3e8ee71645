"""GDN checkpoints captured inside a prefill (prefix caching without splitting the prefill):
the chunked kernel's state at each cut, the conv window there, and the engine's checkpoints,
against a prefill split at the same positions (or a recompute); and caching on adds no step."""

from __future__ import annotations

import random

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.kernels import causal_conv1d_varlen, chunk_gated_delta_rule, conv_windows_at
from hybrid_engine.kernels.gdn import naive_gated_delta_rule
from hybrid_engine.kernels.gdn.chunk import ChunkLayout

from spec_models import make_spec_checkpoint

EXACT = dict(atol=1e-6, rtol=0)


def gdn_inputs(T, Hk=2, Hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, Hk, dk, generator=gen), torch.randn(T, Hk, dk, generator=gen)
    v = torch.randn(T, Hv, dv, generator=gen)
    g = -torch.rand(T, Hv, generator=gen)
    beta = torch.rand(T, Hv, generator=gen)
    return q, k, v, g, beta


def test_chunk_states_at_cuts_equal_a_prefill_split_there():
    # cuts at offsets that are not multiples of 64, two in one sequence, one at a sequence's end
    lengths, cuts = [150, 37, 100], [[40, 112], [], [96, 100]]
    q, k, v, g, beta = gdn_inputs(sum(lengths))
    cu = torch.tensor([0, 150, 187, 287])
    init = 0.5 * torch.randn(3, 4, 16, 8, generator=torch.Generator().manual_seed(1))
    pool = torch.zeros(6, 4, 16, 8)
    slots = torch.tensor([4, 0, 5, 2])
    o, final = chunk_gated_delta_rule(q, k, v, g, beta, cu, init, layout=ChunkLayout(lengths, cuts=cuts),
                                      capture_pool=pool, capture_slots=slots)
    o_uncut, final_uncut = chunk_gated_delta_rule(q, k, v, g, beta, cu, init)
    torch.testing.assert_close(o, o_uncut, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_uncut, atol=1e-5, rtol=1e-5)

    split_outputs, split_states = [], []
    for i, n in enumerate(lengths):
        state, begin = init[i:i + 1], cu[i].item()
        for a, b in zip([0, *cuts[i]], [*cuts[i], n]):
            if a == b:
                continue
            rows = slice(begin + a, begin + b)
            out, state = chunk_gated_delta_rule(q[rows], k[rows], v[rows], g[rows], beta[rows],
                                                torch.tensor([0, b - a]), state)
            split_outputs.append(out)
            if b in cuts[i]:
                split_states.append(state[0])
    torch.testing.assert_close(o, torch.cat(split_outputs), **EXACT)
    torch.testing.assert_close(pool[slots], torch.stack(split_states), **EXACT)
    # and the state at 40 of the first sequence is the plain recurrence's
    _, naive = naive_gated_delta_rule(q[:40], k[:40], v[:40], g[:40], beta[:40], init[0])
    torch.testing.assert_close(pool[4], naive, atol=1e-5, rtol=1e-5)
    assert pool[[1, 3]].eq(0).all()                         # nothing written elsewhere


def test_chunk_layout_rejects_cuts_outside_the_sequence():
    for cuts in ([[0]], [[30, 20]], [[41]]):
        with pytest.raises(ValueError):
            ChunkLayout([40], cuts=cuts)


def test_conv_windows_at_equal_the_final_window_of_a_prefill_ending_there():
    gen = torch.Generator().manual_seed(3)
    D, K = 6, 4
    lengths = [9, 5]
    x = torch.randn(sum(lengths), D, generator=gen)
    weight = torch.randn(D, K, generator=gen)
    window = torch.randn(2, D, K - 1, generator=gen)
    cu = torch.tensor([0, 9, 14])
    # offsets 2 (reaching into the initial window), 7 and the end of the first; 3 of the second
    seqs, offsets = [0, 0, 0, 1], [2, 7, 9, 3]
    ends = torch.tensor([cu[s].item() + o for s, o in zip(seqs, offsets)])
    got = conv_windows_at(x, cu, window, torch.tensor(seqs), ends)
    for c, (s, o) in enumerate(zip(seqs, offsets)):
        begin = cu[s].item()
        _, expect = causal_conv1d_varlen(x[begin:begin + o], weight, torch.tensor([0, o]), window[s:s + 1])
        torch.testing.assert_close(got[c], expect[0], atol=0, rtol=0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("qwen3_5"), "qwen3_5", embed_scale=1.6))


def test_checkpoint_inside_one_chunk_equals_the_recomputed_state(ckpt):
    """A 110-token prompt prefilled in one step leaves its checkpoint at 96 (not a multiple of
    64) from that step's forward; it equals the state of a prefill of just those 96 tokens."""
    rng = random.Random(4)
    prompt = [rng.randrange(256) for _ in range(110)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    on = LLMEngine(EngineConfig(model=ckpt, dtype="float32", enable_prefix_caching=True))
    on.add_request(prompt, params, request_id="a")
    assert on.step()[0].finished                            # one step: prefill and its token
    (checkpoint,) = on.cache.prefix_store.checkpoints.published()
    assert checkpoint.num_tokens == 96
    off = LLMEngine(EngineConfig(model=ckpt, dtype="float32"))
    off.add_request(prompt[:96], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), request_id="b")
    off.step()                                              # the prefill: its slot holds the state at 96
    slot = off.cache.get("b").slot
    ours, theirs = on.cache.pools, off.cache.pools
    for cached, recomputed in zip(ours.checkpoint_conv_states + ours.checkpoint_recurrent_states,
                                  theirs.conv_states + theirs.recurrent_states):
        torch.testing.assert_close(cached[checkpoint.entry], recomputed[slot], **EXACT)


@pytest.mark.parametrize("k", [0, 2])
def test_caching_on_adds_no_prefill_step(ckpt, k):
    """No reuse, chunked prefill with checkpoints wanted inside chunks (every 32 tokens and at
    each prompt's last block boundary): the steps until every request has its first token, and
    the tokens, are the same with caching on and off."""
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (150, 77, 45)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    results = {}
    for on in (False, True):
        engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_batched_tokens=100, max_num_seqs=4,
                                        speculative_config=spec, enable_prefix_caching=on,
                                        prefix_checkpoint_interval=32 if on else None))
        for i, p in enumerate(prompts):
            engine.add_request(p, params, request_id=str(i))
        first_token_step, tokens, steps = {}, {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                first_token_step.setdefault(out.request_id, steps)
                tokens[out.request_id] = out.token_ids
        results[on] = (first_token_step, tokens)
        if on:
            assert engine.prefix_cache_stats["checkpoints_taken"] >= 6
    assert results[True] == results[False]


def test_a_failed_forward_publishes_no_unwritten_checkpoint(ckpt):
    """The checkpoints reserved for a forward that raises are withdrawn: a later request with
    the same prompt finds no prefix to resume from, and its output equals the plain run's."""
    rng = random.Random(6)
    prompt = [rng.randrange(256) for _ in range(110)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", enable_prefix_caching=True))
    forward = engine.runner.forward

    def failing(inputs):
        assert inputs.batch.gdn_captures is not None        # this step meant to write one
        raise RuntimeError("forward failed")

    engine.runner.forward = failing
    engine.add_request(prompt, params, request_id="a")
    with pytest.raises(RuntimeError, match="forward failed"):
        engine.step()
    engine.abort_request("a")
    assert engine.cache.prefix_store.checkpoints.published() == []
    engine.runner.forward = forward
    engine.add_request(prompt, params, request_id="b")
    while engine.has_unfinished_requests():
        for out in engine.step():
            got = out.token_ids
    assert engine.prefix.stats.num_hit_tokens == 0
    plain = LLMEngine(EngineConfig(model=ckpt, dtype="float32"))
    plain.add_request(prompt, params, request_id="c")
    while plain.has_unfinished_requests():
        for out in plain.step():
            want = out.token_ids
    assert got == want
