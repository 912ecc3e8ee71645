"""Per-step bookkeeping: the steady-state decode inputs equal a fresh pack, outputs handed out
earlier never change, and token and KV-slot slices match the per-token definitions."""

import random

import dataclasses

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.step_inputs import StepInputBuilder

from checkpoints import make_hf_model, save_checkpoint

BATCH_TENSORS = ("positions", "cu_seqlens", "seq_lens", "slot_mapping", "block_tables", "state_slots",
                 "has_initial_state", "state_write_slots", "logits_indices")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dense")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, add_mtp=True)
    return str(folder)


def _engine(ckpt, keyless=None, **kw):
    """keyless: the builder's keyless_query_lens, whatever the engine chose for this machine's
    kernels (frozenset(): the steady state updates the attention keys; {1}: it has none, which
    only a backend whose attention reads the cache in place may run)."""
    engine = LLMEngine(EngineConfig(model=ckpt, dtype="float32", block_size=4, max_num_seqs=6,
                                    max_num_batched_tokens=64, **kw))
    if keyless is not None:
        heads = engine.model_config.num_attention_heads
        if any(engine.kernels.attention_reads_keys(kv, heads, q) for q in keyless for kv in engine.cache.pools.kv_caches):
            # the engine never leaves keys out there (LLMEngine._keyless_query_lens): no kernel could run the step
            pytest.skip(f"query lengths {sorted(keyless)} without attention keys need a kernel that reads the "
                        "cache in place (the native one), which this CPU level does not build")
        engine.builder.keyless_query_lens = keyless
        if engine.runner.drafts is not None:       # and the drafter's passes
            engine.runner.drafts.keyless_query_lens = keyless
            engine.runner.passes = dataclasses.replace(engine.runner.passes, keyless=1 in keyless)
    return engine


def _assert_same_inputs(got, want):
    assert torch.equal(got.input_ids, want.input_ids)
    for name in BATCH_TENSORS:
        a, b = getattr(got.batch, name), getattr(want.batch, name)
        assert a.shape == b.shape and torch.equal(a, b), name
    for name in ("num_prefills", "num_prefill_tokens", "decode_len", "decode_rows", "kernels"):
        assert getattr(got.batch, name) == getattr(want.batch, name), name
    # the step's facts: the attention layout (recomputed by the steady state too)
    a, b = got.batch.attention, want.batch.attention
    assert a.slots_valid == b.slots_valid and a.query_len == b.query_len and (a.keys is None) == (b.keys is None)
    pairs = [(a.keys, b.keys)] if a.keys is not None else [(x.keys, y.keys) for x, y in zip(a.groups, b.groups)]
    for x, y in pairs:
        for name in ("blocks", "offsets", "visible"):
            assert torch.equal(getattr(x, name), getattr(y, name)), name
    fields = lambda s: (s.request, s.start, s.num_tokens, s.first_row, s.is_decode, s.samples)
    assert [fields(s) for s in got.segments] == [fields(s) for s in want.segments]
    assert [(fields(s), first, n) for s, first, n in got.sample_spans] == \
           [(fields(s), first, n) for s, first, n in want.sample_spans]


def _check_every_build(engine) -> list[int]:
    """Makes every build compare its inputs with a pack from scratch into fresh buffers;
    -> a counter of steps that took the steady-state path."""
    b = engine.builder
    fresh = StepInputBuilder(b.input_ids.numel(), b.seq_lens.numel(), b.block_tables.shape[1], b.block_size,
                             keyless_query_lens=b.keyless_query_lens)
    fresh.kernels = b.kernels
    # The fresh packs write their buffers with torch copies (the path off CPU), the engine's
    # builder through numpy views of them (StepInputBuilder._put): both must give the same inputs.
    assert b._host is not None
    fresh._host = None
    build, num_steady = b.build, [0]

    def checked_build(sched, cache):
        steady = not sched.prefills and b._last_decode is not None
        inputs = build(sched, cache)
        num_steady[0] += steady and b._last_decode.inputs is inputs and inputs.batch.num_decodes > 0
        _assert_same_inputs(inputs, fresh._pack(inputs.segments, inputs.batch.num_prefills, cache))
        return inputs

    b.build = checked_build
    return num_steady


KEYLESS = [frozenset(), frozenset({1})]


@pytest.mark.parametrize("keyless", KEYLESS)
def test_steady_state_decode_inputs_equal_a_fresh_pack(ckpt, keyless):
    """Arrivals, finishes at different lengths, an abort and block boundaries every 4 tokens."""
    engine = _engine(ckpt, keyless)
    num_steady = _check_every_build(engine)
    rng = random.Random(0)
    arrivals = {0: 3, 1: 1, 9: 2, 30: 1}
    step, done = 0, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in range(arrivals.get(step, 0)):
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 13))]
            max_tokens = 40 if step == i == 0 else rng.randint(5, 30)
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                               request_id=f"{step}.{i}")
        if step == 20:
            assert engine.abort_request("0.0") is not None      # still running: a batch change
        done += sum(o.finished for o in engine.step())
        step += 1
    assert done == 6 and num_steady[0] > 20


@pytest.mark.parametrize("keyless", KEYLESS)
def test_steady_state_widening_clears_stale_block_table_columns(ckpt, keyless):
    """A (row 1, 6 blocks) finishes; C takes row 1 and B, in row 0, then enters its third block
    in place: row 1's third column must read 0, not A's block. Without prefix caching: A and B
    share a block, where caching would end A's prefill chunk and change the steps traced here."""
    engine = _engine(ckpt, keyless, enable_prefix_caching=False)
    num_steady = _check_every_build(engine)
    greedy = dict(temperature=0.0, ignore_eos=True)
    engine.add_request(list(range(6)), SamplingParams(max_tokens=8, **greedy), request_id="B")
    engine.add_request(list(range(20)), SamplingParams(max_tokens=2, **greedy), request_id="A")
    engine.add_request([1], SamplingParams(max_tokens=8, **greedy), request_id="C")
    widths = []
    while engine.has_unfinished_requests():
        engine.step()
        widths.append(engine.builder._last_decode.inputs.batch.block_tables.shape[1]
                      if engine.builder._last_decode is not None else None)
    # Keyless steps widen their tables to powers of two (StepInputBuilder._table_width).
    assert widths[2:4] == ([2, 4] if keyless else [2, 3]) and num_steady[0] > 0


@pytest.mark.parametrize("keyless", KEYLESS)
def test_steady_decode_keeps_its_batch_across_block_boundaries_where_keyless(ckpt, keyless):
    """One request decodes through 12 blocks of 4 tokens. Without keys, its table is as wide as
    the next power of two of its blocks, so the steady state hands the same batch object (what a
    compiled step replays) to every step between widths 2, 4, 8 and 16; with keys, it is exactly
    as wide as its blocks, and a new object at each of them."""
    engine = _engine(ckpt, keyless, enable_prefix_caching=False)
    num_steady = _check_every_build(engine)
    engine.add_request([5], SamplingParams(temperature=0.0, max_tokens=46, ignore_eos=True))
    engine.step()                                                # the prompt
    batches, widths = [], []
    while engine.has_unfinished_requests():
        engine.step()
        batch = engine.builder._last_decode.inputs.batch
        if not batches or batch is not batches[-1]:
            batches.append(batch)
        widths.append(batch.block_tables.shape[1])
    needed = [(2 + i + 3) // 4 for i in range(len(widths))]      # blocks of a step at position 1 + i
    want = [1 << (b - 1).bit_length() for b in needed] if keyless else needed
    assert widths == want and num_steady[0] == len(widths) - 1
    assert len(batches) == len(set(want))


def test_decode_steps_carry_attention_keys_only_where_a_layer_reads_them(ckpt):
    """The engine leaves the keys out of plain decode steps where the native kernel serves every
    attention layer (and keeps them where not), with the tokens of a run that keeps them."""
    tokens, keys_seen = {}, {}
    for keyless in (None, frozenset()):
        engine = _engine(ckpt, keyless)
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        ids = [engine.add_request([3, 1, 4, 1, 5][:n], params) for n in (2, 5)]
        keys_seen[keyless] = set()
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.token_ids) for o in engine.step())
            if engine.builder._last_decode is not None:
                keys_seen[keyless].add(engine.builder._last_decode.inputs.batch.attention.keys is not None)
        tokens[keyless] = [outs[i] for i in ids]
        if keyless is None:
            native = not engine.kernels.attention_reads_keys(engine.cache.pools.kv_caches[0],
                                                             engine.model_config.num_attention_heads, 1)
            assert engine.builder.keyless_query_lens == (frozenset({1}) if native else frozenset())
    assert keys_seen == {None: {not native}, frozenset(): {True}}
    assert tokens[None] == tokens[frozenset()]


def test_mtp_passes_carry_attention_keys_only_where_a_layer_reads_them(ckpt):
    """With k drafts the engine leaves the keys out of every query length 1..k+1 the native
    kernel serves in all attention layers (the MTP layer's included), the drafter's passes too,
    with the tokens of a run that keeps them."""
    k, tokens, keys_seen = 3, {}, {}
    for keyless in (None, frozenset()):
        engine = _engine(ckpt, keyless, speculative_config={"method": "mtp", "num_speculative_tokens": k})
        build = engine.runner.drafts.build
        seen = keys_seen[keyless] = set()

        def recording(segs, *args, build=build, seen=seen):
            inputs = build(segs, *args)
            if len({n for _, n, _ in segs}) == 1:
                seen.add((segs[0][1], inputs.batch.attention.keys is not None))
            return inputs
        engine.runner.drafts.build = recording
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        ids = [engine.add_request([3, 1, 4, 1, 5][:n], params) for n in (2, 5)]
        outs = {}
        while engine.has_unfinished_requests():
            outs.update((o.request_id, o.token_ids) for o in engine.step())
        tokens[keyless] = [outs[i] for i in ids]
        if keyless is None:
            heads = engine.model_config.num_attention_heads
            served = {q for q in range(1, k + 2)
                      if not any(engine.kernels.attention_reads_keys(kv, heads, q) for kv in engine.cache.pools.kv_caches)}
            assert engine.builder.keyless_query_lens == frozenset(served)
    assert {n for n, _ in keys_seen[None]} & {1, 2}          # drafts and some catch-ups ran
    assert keys_seen[None] == {(n, n not in served) for n, _ in keys_seen[None]}
    assert {has for _, has in keys_seen[frozenset()]} == {True}
    assert tokens[None] == tokens[frozenset()]


def test_earlier_outputs_do_not_change(ckpt):
    engine = _engine(ckpt)
    params = SamplingParams(temperature=0.8, seed=1, max_tokens=9, logprobs=2, ignore_eos=True)
    rid = engine.add_request([1, 2, 3], params)
    outs, seen, read_early = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.append(o)
            seen.append(seen[-1] + o.new_token_ids if seen else list(o.new_token_ids))
            if len(outs) == 3:
                read_early = (list(o.token_ids), list(o.logprobs))   # read before later steps
    assert [len(o.token_ids) for o in outs] == list(range(1, 10))
    assert [o.token_ids for o in outs] == seen
    assert [len(o.logprobs) for o in outs] == list(range(1, 10))
    final = outs[-1]
    assert final.finished and final.request_id == rid
    for o in outs:
        n = len(o.token_ids)
        assert o.logprobs == final.logprobs[:n]
        assert all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
    assert read_early == (outs[2].token_ids, outs[2].logprobs) == (final.token_ids[:3], final.logprobs[:3])


def test_mtp_passes_are_packed_in_buffers_of_their_own(ckpt):
    """The drafter's catch-up passes read the drafting builder's persistent buffers (no copies
    of their own), with the facts a pass needs (the MTP layer is attention only), and never the
    step builder's: drafting leaves a step's inputs as they were."""
    engine = _engine(ckpt, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    drafts, step, passes = engine.runner.drafts, engine.builder, []
    build = drafts.build
    names = ("positions", "cu_seqlens", "seq_lens", "slot_mapping", "block_tables")

    def recorded(segs, tokens, hidden, drafting, lookahead):
        before = {name: getattr(step, name).clone() for name in names}
        out = build(segs, tokens, hidden, drafting, lookahead)
        # read now: later steps overwrite the buffers these views show
        assert out.batch.seq_lens.tolist() == [start + n for start, n, _ in segs]
        assert out.tokens.tolist() == tokens and out.seqs.tolist() == drafting
        assert all(torch.equal(getattr(step, name), before[name]) for name in names)
        passes.append(out.batch)
        return out

    drafts.build = recorded
    for prompt in ([5, 17, 3, 99, 250, 8], [1, 2, 3]):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(passes) > 4
    for fb in passes:
        for name in names:
            assert getattr(fb, name).data_ptr() == getattr(drafts, name).data_ptr(), name
