"""One engine loop, many callers: threads sharing an LLM, isolated streams, abandoned streams,
request ids, and a failing step that ends only its own requests."""

import gc
import random
import threading

import pytest

from hybrid_engine import LLM, LLMEngine, EngineConfig, SamplingParams
from hybrid_engine.engine_loop import EngineLoop

from checkpoints import make_hf_model, save_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loop")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, tokenizer=True)
    return folder


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), dtype="float32", max_num_seqs=8, max_num_batched_tokens=128)


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def settled(llm):
    """The engine's state once the loop has run every command submitted so far."""
    return llm.loop.run_on_loop(lambda e: (e.has_unfinished_requests(), e.cache.num_free_blocks,
                                           e.cache.num_free_slots))


def assert_no_leak(llm):
    assert settled(llm) == (False, llm.engine.cache.num_blocks, llm.engine.cache.num_slots)


def test_eight_threads_sharing_one_llm_get_their_solo_outputs(ckpt, llm):
    rng = random.Random(7)
    jobs = [[([rng.randrange(256) for _ in range(rng.randint(1, 60))], rng.randint(1, 10))
             for _ in range(rng.randint(1, 3))] for _ in range(8 * 3)]
    solo_llm = LLM(model=str(ckpt), dtype="float32")
    solo = [[solo_llm.generate(p, greedy(n), use_tqdm=False)[0].token_ids for p, n in job] for job in jobs]
    results, errors = {}, []

    def worker(t):
        try:
            for j in range(t, len(jobs), 8):
                outs = llm.generate([p for p, _ in jobs[j]], [greedy(n) for _, n in jobs[j]], use_tqdm=False)
                results[j] = [o.token_ids for o in outs]
        except Exception as e:  # surfaced below: an assert inside a thread would be lost
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert [results[j] for j in range(len(jobs))] == solo
    assert_no_leak(llm)


def test_interleaved_streams_see_only_their_own_requests(llm):
    a = llm.generate_stream([[1, 2, 3], [4, 5]], greedy(6))
    b = llm.generate_stream([7, 8, 9], greedy(9))
    seen = {"a": [], "b": []}
    for name, it in [("a", a), ("b", b)] * 3:
        seen[name].append(next(it))
    seen["a"] += list(a)
    seen["b"] += list(b)
    ids_a = {o.request_id for o in seen["a"]}
    ids_b = {o.request_id for o in seen["b"]}
    assert len(ids_a) == 2 and len(ids_b) == 1 and not ids_a & ids_b
    assert all(o.prompt_token_ids in ([1, 2, 3], [4, 5]) for o in seen["a"])
    assert all(o.prompt_token_ids == [7, 8, 9] for o in seen["b"])
    finals = [o for o in seen["a"] + seen["b"] if o.finished]
    assert sorted(len(o.token_ids) for o in finals) == [6, 6, 9]
    assert_no_leak(llm)


def test_abandoned_stream_frees_its_memory(llm):
    stream = llm.generate_stream(list(range(1, 80)), greedy(3000))
    first = next(stream)
    assert not first.finished
    assert settled(llm)[0]                     # the request is running
    del stream
    gc.collect()
    assert_no_leak(llm)
    # a RequestStream from the loop itself, never iterated, then dropped
    handle = llm.loop.submit(list(range(1, 40)), greedy(3000))
    assert settled(llm)[0]
    del handle
    gc.collect()
    assert_no_leak(llm)


def test_short_generate_does_not_wait_for_a_half_read_stream(llm):
    stream = llm.generate_stream([5, 6, 7], greedy(3000))
    next(stream)
    out = llm.generate([1, 2], greedy(2), use_tqdm=False)[0]
    assert len(out.token_ids) == 2 and out.finished
    # the stream kept its own outputs: the next one carries the tokens generated meanwhile
    later = next(stream)
    assert later.request_id != out.request_id and len(later.token_ids) >= 2 and not later.finished
    stream.close()
    assert_no_leak(llm)


def test_automatic_ids_never_collide_with_chosen_ones(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32"))
    engine.add_request([1, 2], greedy(1), "100")
    engine.add_request([1, 2], greedy(1), "3")
    ids = {engine.add_request([1, 2], greedy(1)) for _ in range(150)}
    assert len(ids) == 150 and not ids & {"100", "3"}

    loop = EngineLoop(lambda: LLMEngine(EngineConfig(model=str(ckpt), dtype="float32")))
    chosen = loop.submit([1, 2], greedy(50), request_id="5")
    with pytest.raises(ValueError, match="already in use"):
        loop.submit([1, 2], greedy(1), request_id="5")
    auto = [loop.submit([1, 2], greedy(1)) for _ in range(20)]
    assert "5" not in {s.request_id for s in auto}
    assert all(len(list(s)[-1].token_ids) == 1 for s in auto)
    assert len(list(chosen)[-1].token_ids) == 50
    loop.shutdown()


def test_a_callers_id_never_collides_with_a_samples_id(ckpt):
    engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32"))
    engine.add_request([1, 2, 3], greedy(3), "0_5")                   # vLLM's form of sample 0 of "5"
    engine.add_request([4, 5], SamplingParams(n=2, max_tokens=3, ignore_eos=True, seed=0), "5")
    with pytest.raises(ValueError, match="'x#sample1' ends in '#sample<number>'"):
        engine.add_request([1], greedy(3), "x#sample1")
    finals = {}
    while engine.has_unfinished_requests():
        finals.update((out.request_id, out) for out in engine.step() if out.finished)
    assert {rid: out.prompt_token_ids for rid, out in finals.items()} == {"0_5": [1, 2, 3], "5": [4, 5]}
    assert [len(c.token_ids) for c in finals["0_5"].outputs + finals["5"].outputs] == [3, 3, 3]


def test_a_failing_step_ends_its_requests_with_the_error_and_the_loop_serves_on(llm, monkeypatch):
    engine = llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def step_failing_once():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_step()

    received, done = [], threading.Event()

    def on_output(out):
        received.append(out)
        if out.finished:
            done.set()

    settled(llm)
    monkeypatch.setattr(engine, "step", step_failing_once)
    broken = llm.loop.submit([1, 2, 3], greedy(4))
    with pytest.raises(RuntimeError, match="injected"):
        list(broken)
    llm.loop.submit([1, 2, 3], greedy(4), on_output=on_output)
    assert done.wait(60)
    assert len(received[-1].token_ids) == 4
    assert_no_leak(llm)
    monkeypatch.setattr(engine, "step", real_step)
    assert llm.generate([1, 2, 3], greedy(4), use_tqdm=False)[0].token_ids == received[-1].token_ids


def test_submit_validates_in_the_callers_thread_and_queues_nothing(llm):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.loop.submit([1, 10**6], greedy(2))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.loop.submit([1], SamplingParams(max_tokens=0))
    assert_no_leak(llm)


def test_shutdown_aborts_what_runs(ckpt):
    loop = EngineLoop(lambda: LLMEngine(EngineConfig(model=str(ckpt), dtype="float32")))
    outputs = iter(loop.submit([1, 2, 3], greedy(3000)))
    next(outputs)
    loop.shutdown()
    assert loop.engine.cache.num_free_blocks == loop.engine.cache.num_blocks
    assert list(outputs)[-1].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="shut down"):
        loop.submit([1], greedy(1))


def test_llm_seed_makes_unseeded_samples_reproducible(ckpt):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 2, 3], [9, 8], [4, 4, 4, 4]]

    def run(seed):
        llm = LLM(model=str(ckpt), dtype="float32", seed=seed)
        return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    first = run(0)
    assert run(0) == first
    assert run(1) != first
    assert params.seed is None                        # the caller's params are left as given
    seeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5)
    a = LLM(model=str(ckpt), dtype="float32", seed=0).generate([1, 2, 3], seeded, use_tqdm=False)[0]
    b = LLM(model=str(ckpt), dtype="float32", seed=1).generate([1, 2, 3], seeded, use_tqdm=False)[0]
    assert a.token_ids == b.token_ids                 # a request's own seed wins


def test_the_engine_is_built_on_the_loop_thread_and_a_failed_build_raises_in_the_caller(ckpt):
    # one thread runs torch's parallel ops: building on the caller's thread left two OpenMP teams
    built_on = []

    def make():
        built_on.append(threading.current_thread())
        return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32"))
    loop = EngineLoop(make)
    assert built_on == [loop.run_on_loop(lambda engine: threading.current_thread())]
    assert built_on[0] is not threading.current_thread()
    assert len(list(loop.submit([1, 2], greedy(3)))[-1].token_ids) == 3
    loop.shutdown()

    def broken():
        raise ValueError("no such model")
    with pytest.raises(ValueError, match="no such model"):
        EngineLoop(broken)
