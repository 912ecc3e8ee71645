"""enable_torch_compile (hybrid_engine/compiled_steps.py): decode, verify and MTP drafting run
through torch.compile give the eager engine's tokens and (within float32 rounding) logprobs,
batches of every size reuse the graphs made for the first ones, and nothing leaks.

Compiling takes a while on 2 cores (a few graphs of a 2-layer model, about a minute in all),
so the engines here are module-scoped and shared by the tests."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.compiled_steps import CompiledSteps

from spec_models import make_spec_checkpoint
from staggered import run_staggered, staggered_workload


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_spec_checkpoint(tmp_path_factory.mktemp("compiled"), "qwen3_5", embed_scale=1.6))


def _engine(ckpt, k: int, compiled: bool) -> LLMEngine:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    return LLMEngine(EngineConfig(model=ckpt, dtype="float32", max_num_seqs=6, block_size=4,
                                  max_num_batched_tokens=64, speculative_config=spec,
                                  enable_torch_compile=compiled))


class _Counted:
    """Counts the steps and drafting calls that went through the compiled functions, by batch size."""

    def __init__(self, compiled: CompiledSteps):
        self.decode, self.mtp, self.draft_passes = [], [], []
        forward, draft = compiled.forward, compiled.draft

        def counted_forward(inputs):
            b = inputs.batch
            if not b.num_prefill_tokens:
                self.decode.append((b.decode_len, b.num_decodes))
            return forward(inputs)

        def counted_draft(d, passes, masks=None):
            (self.mtp if d.one_length else self.draft_passes).append(d.rows.numel())
            return draft(d, passes, masks)

        compiled.forward, compiled.draft = counted_forward, counted_draft


@pytest.fixture(scope="module")
def eager_runs(ckpt):
    """Reference outputs of the eager engine, without and with MTP (k=2), for two workloads."""
    return {(k, seed): run_staggered(_engine(ckpt, k, False), *staggered_workload(seed, logprobs=0))
            for k in (0, 2) for seed in (0, 1)}


def _keyless(engine: LLMEngine, k: int) -> bool:
    """Whether every attention call of a k-draft engine's decode/verify steps (1 + k tokens),
    catch-ups (1..1 + k) and draft passes (1) reads no PagedKeys (the native CPU kernel)."""
    return set(range(1, k + 2)) <= engine.builder.keyless_query_lens


def _unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("k", [0, 2])
def test_compiled_steps_match_eager(ckpt, eager_runs, k):
    engine = _engine(ckpt, k, True)
    assert isinstance(engine.runner.execution, CompiledSteps)
    counted = _Counted(engine.runner.execution)
    # Where attention takes PagedKeys (level none), drafting's keyed graphs also specialize on
    # catch-up lengths of 1 (dynamo's 0/1 specialization), which the second workload may meet
    # first; there the repeat of that workload must compile nothing.
    keyless = _keyless(engine, k)
    for run, seed in enumerate((0, 1, 1)):
        graphs_before = _unique_graphs()
        outs = run_staggered(engine, *staggered_workload(seed, logprobs=0))
        same_k, plain = eager_runs[(k, seed)], eager_runs[(0, seed)]
        assert [o.token_ids for o in outs] == [o.token_ids for o in same_k]
        # Greedy speculation gives the plain greedy tokens (the sampled last request may not).
        assert [o.token_ids for o in outs[:5]] == [o.token_ids for o in plain[:5]]
        for out, ref in zip(outs, same_k):
            got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
            want = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)]
            assert got == pytest.approx(want, abs=2e-5)
        if run == 2 or (run == 1 and keyless):
            # The first workload(s) made every graph: batch sizes 1..6, all block-table widths.
            assert _unique_graphs() == graphs_before
    assert {n for _, n in counted.decode} >= {1, 2, 3}, "compiled decode steps of several batch sizes"
    assert {L for L, _ in counted.decode} == {1 + k}
    if k:
        assert len(counted.mtp) > 0                  # drafting after a verify's catch-up
        assert len(counted.draft_passes) > 0         # the draft passes after a prompt's
    assert engine.cache.num_free_slots == engine.cache.num_slots
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_compile_option_is_validated():
    with pytest.raises(ValueError, match="enable_torch_compile"):
        EngineConfig(enable_torch_compile="yes").validate()


def test_steady_decode_replays_its_graph(ckpt, eager_runs):
    """Plain decode steps that pass the last step's batch again replay its graph
    (hybrid_engine/graph_replay.py); steps of another batch size, a wider block table or a
    repacked batch go through dynamo; every token and logprob is the eager engine's."""
    engine = _engine(ckpt, 0, True)
    compiled = engine.runner.execution
    calls, last = [], [None]
    forward = compiled.forward

    def watched(inputs):
        if not inputs.batch.num_prefill_tokens:
            calls.append(inputs.batch is last[0])
            last[0] = inputs.batch
        return forward(inputs)

    compiled.forward = watched
    replay = compiled._decode_replay
    outs = run_staggered(engine, *staggered_workload(0, logprobs=0))
    ref = eager_runs[(0, 0)]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    for out, want in zip(outs, ref):
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(want.logprobs, want.token_ids)], abs=2e-5)
    # The first call of each batch object goes through dynamo, every later one replays.
    assert replay.replays == sum(calls) > 0 and not all(calls)
    # A long single request through 4-token blocks (positions 8..47: 3 to 12 blocks). With keys,
    # its table widens at every block, each a new batch; without them (the native kernel), only
    # at widths 4, 8 and 16 (StepInputBuilder._table_width). A first decode step packed into
    # the views of the last one (the same width) replays too.
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    eager = _engine(ckpt, 0, False)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    before, calls[:] = replay.replays, []
    got = run_staggered(engine, [prompt], params, [0])[0]
    want = run_staggered(eager, [prompt], params, [0])[0]
    assert got.token_ids == want.token_ids
    replayed, steps = replay.replays - before, len(calls)
    assert replayed >= sum(calls) and steps == 39
    if _keyless(engine, 0):
        assert steps - replayed <= 3
    else:
        assert steps - replayed >= 9


def test_graph_cache_is_keyed_by_the_native_ops(monkeypatch):
    """Inductor's on-disk cache keys a graph by its code and config, not by the ops it calls: the
    engine's backend compiles with torch.compiler.config.cache_key_tag set to the native library's
    name (its sources' key) and a digest of the fakes, so a graph compiled against other ops (an
    earlier schema or fake) is never served."""
    import hybrid_engine.compiled_steps as compiled_steps
    from hybrid_engine.kernels.native.build import library_name
    from hybrid_engine.kernels.native.ops import graph_cache_tag

    tag = graph_cache_tag()
    name = library_name()
    assert tag.startswith(f"{name}:" if name is not None else "no-native-ops:") and len(tag.split(":")[1]) == 16
    seen = []
    monkeypatch.setattr(compiled_steps, "compile_fx",
                        lambda graph, inputs: seen.append(torch.compiler.config.cache_key_tag) or graph)
    compiled_steps._inductor(False)(torch.fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)])
    assert seen == [tag] and torch.compiler.config.cache_key_tag == ""


def test_verify_steps_and_their_drafting_replay(ckpt):
    """A verify step packed afresh into the same views of the builder's buffers as the last one
    (same request, same table width), and the drafting after it, replay their graphs
    (compiled_steps.same_views); the tokens are the eager engine's and plain greedy decode's.
    Where attention needs PagedKeys (level none: no native kernel), each step's keys are new
    tensors, so nothing is replayed there."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    engine = _engine(ckpt, 2, True)
    got = run_staggered(engine, [prompt], params, [0])[0]
    want = run_staggered(_engine(ckpt, 2, False), [prompt], params, [0])[0]
    plain = run_staggered(_engine(ckpt, 0, False), [prompt], params, [0])[0]
    assert got.token_ids == want.token_ids == plain.token_ids
    compiled = engine.runner.execution
    keyless = _keyless(engine, 2)
    assert (compiled._decode_replay.replays > 0) == keyless
    assert (compiled._mtp_replay.replays > 0) == keyless


def test_same_views_compares_memory_and_host_values():
    from dataclasses import replace

    from hybrid_engine.compiled_steps import same_views
    from hybrid_engine.kernels.slot_pool import DecodeRows
    buf = torch.zeros(8, 4)
    assert same_views(buf[:3], buf[:3]) and same_views((buf[:2], 5), (buf[:2], 5))
    assert not same_views(buf[:3], buf[:2])                  # another shape
    assert not same_views(buf[1:3], buf[:2])                 # another address
    assert not same_views(buf[:2], buf.t()[:2])              # other strides
    assert not same_views(buf[:2], buf[:2].clone())          # other memory
    assert not same_views((buf[:2], 5), (buf[:2], 6))        # another host int
    rows = DecodeRows(True, True, True, read_ids=(1, 2))
    assert same_views(rows, replace(rows, read_ids=(3, 4)))  # slot ids: traced steps never read them
    assert not same_views(rows, replace(rows, in_place=False))
    assert not same_views(object(), object())                # other objects: only the same one
