"""Faults injected into the engine and its loop: a step that raises (before, inside or after the
forward), an abort that raises (alone, or while cleaning up after a failed step), a command
that raises, a consumer callback that raises, an error escaping the loop's body. After each,
every later call either works (with a clean engine's tokens) or raises at once; none waits
forever (each loop test runs under a watchdog)."""

import pytest

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.engine import EngineDeadError, StepFailedError
from hybrid_engine.request_group import sample_request_id

from checkpoints import make_hf_model, save_checkpoint
from watchdog import within

# Longer than a block (16): the prefix cache shares what a failed request committed.
PROMPTS = {"a": [5, 6, 7, 8, 9] * 8, "b": [11, 12, 13] * 7, "c": [21, 22, 23, 24] * 5}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
WATCHDOG_S = 60


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    save_checkpoint(make_hf_model("qwen3_5", full_attention_interval=2), folder, add_mtp=True)
    return folder


def greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make_engine(ckpt, spec=None, max_num_seqs=2):
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=128, speculative_config=spec))


def fail(monkeypatch, owner, name, times=1):
    """owner.name raises InjectedFault on its next `times` calls, then works again."""
    real, left = getattr(owner, name), [times]

    def failing(*args, **kwargs):
        if left[0] > 0:
            left[0] -= 1
            raise InjectedFault(f"injected fault in {name}")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, failing)


def keep_stepping(engine):
    """Steps until nothing is left, going on after a step that raises (as a caller of the bare
    engine might) -> (finished outputs by request id, the errors raised)."""
    finals, errors = {}, []
    while engine.has_unfinished_requests():
        try:
            finals.update((out.request_id, out) for out in engine.step() if out.finished)
        except StepFailedError as e:
            errors.append(e)
    return finals, errors


def assert_all_free(engine):
    assert not engine.has_unfinished_requests() and not engine.requests and not engine.groups
    assert (engine.cache.num_free_blocks, engine.cache.num_free_slots) == (engine.cache.num_blocks,
                                                                           engine.cache.num_slots)


@pytest.fixture(scope="module")
def clean(ckpt):
    """Each prompt's 12 greedy tokens from an engine that never failed, plain and with MTP."""
    result = {}
    for spec in (None, MTP):
        engine = make_engine(ckpt, spec, max_num_seqs=8)
        for rid, prompt in PROMPTS.items():
            engine.add_request(prompt, greedy(12), rid)
        finals, _ = keep_stepping(engine)
        result[spec is not None] = {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()}
    return result


# ---- the bare engine -------------------------------------------------------------------------

@pytest.mark.parametrize("mtp", [False, True], ids=["plain", "mtp"])
@pytest.mark.parametrize("where", [("runner", "forward"), ("updater", "update"), ("updater", "_append_token")],
                         ids=["in-forward", "before-update", "mid-update"])
def test_a_failed_step_aborts_its_requests_and_every_later_output_is_a_clean_engines(ckpt, clean, monkeypatch,
                                                                                        mtp, where):
    engine = make_engine(ckpt, MTP if mtp else None)
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, greedy(12), rid)   # c waits: max_num_seqs=2
    engine.step()
    engine.step()
    fail(monkeypatch, getattr(engine, where[0]), where[1])
    finals, errors = keep_stepping(engine)
    assert len(errors) == 1 and errors[0].request_ids == ["a", "b"]
    assert isinstance(errors[0].__cause__, InjectedFault)
    # a and b were aborted (kept on, they emitted a wrong extra token); c ran on untouched
    assert {rid: list(out.outputs[0].token_ids) for rid, out in finals.items()} == {"c": clean[mtp]["c"]}
    assert_all_free(engine)
    # a's prompt again, from the blocks the prefix cache kept of a
    engine.add_request(PROMPTS["a"], greedy(12), "a2")
    finals, errors = keep_stepping(engine)
    assert not errors and list(finals["a2"].outputs[0].token_ids) == clean[mtp]["a"]
    assert_all_free(engine)


def test_a_step_that_fails_before_running_any_request_aborts_them_all(ckpt, clean, monkeypatch):
    engine = make_engine(ckpt)
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, greedy(12), rid)
    engine.step()
    fail(monkeypatch, engine.scheduler, "schedule")   # which requests it touched is unknown
    with pytest.raises(StepFailedError, match="injected") as info:
        engine.step()
    assert sorted(info.value.request_ids) == ["a", "b", "c"]
    assert_all_free(engine)
    engine.add_request(PROMPTS["c"], greedy(12), "c2")
    assert list(keep_stepping(engine)[0]["c2"].outputs[0].token_ids) == clean[False]["c"]


def test_a_failed_step_aborts_all_n_samples_of_its_requests(ckpt, monkeypatch):
    engine = make_engine(ckpt, max_num_seqs=4)
    engine.add_request(PROMPTS["a"], SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=1), "r")
    while sample_request_id("r", 2) not in engine.cache:
        engine.step()
    fail(monkeypatch, engine.runner, "forward")
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert info.value.request_ids == ["r"]
    assert_all_free(engine)


@pytest.mark.parametrize("broken_abort", ["raises", "does-nothing"])
def test_when_cleaning_up_a_failed_step_fails_the_engine_refuses_to_go_on(ckpt, monkeypatch, broken_abort):
    engine = make_engine(ckpt)
    engine.add_request(PROMPTS["a"], greedy(12), "a")
    engine.step()
    fail(monkeypatch, engine.runner, "forward")
    if broken_abort == "raises":
        fail(monkeypatch, engine, "abort_request", times=10**9)
    else:
        monkeypatch.setattr(engine, "abort_request", lambda request_id: None)
    with pytest.raises(EngineDeadError, match="state is unknown"):
        engine.step()
    monkeypatch.undo()                  # working again, but nothing can say what the step left
    with pytest.raises(EngineDeadError):
        engine.step()
    with pytest.raises(EngineDeadError):
        engine.add_request(PROMPTS["b"], greedy(2))


# ---- the engine loop -------------------------------------------------------------------------

@pytest.fixture
def llm(ckpt):
    llm = LLM(model=str(ckpt), dtype="float32", max_num_seqs=2, max_num_batched_tokens=128)
    yield llm
    llm.shutdown()


def generate(llm, prompt, n=12):
    return list(llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0].token_ids)


def assert_no_leak(llm):
    within(WATCHDOG_S, lambda: llm.loop.run_on_loop(assert_all_free))


def assert_dead(llm):
    """Every call raises EngineDeadError at once."""
    assert llm.loop.is_dead
    with pytest.raises(EngineDeadError):
        within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"]))
    with pytest.raises(EngineDeadError):
        within(WATCHDOG_S, lambda: llm.loop.run_on_loop(lambda engine: 1))
    with pytest.raises(EngineDeadError):
        llm.loop.submit(PROMPTS["a"], greedy(2))


def test_a_step_that_raises_fails_its_requests_and_the_loop_serves_on(llm, clean, monkeypatch):
    generate(llm, PROMPTS["c"], 2)                      # the loop is idle: the next step is ours
    fail(monkeypatch, llm.engine.runner, "forward")
    with pytest.raises(RuntimeError, match="injected") as info:
        within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"]))
    assert isinstance(info.value.__cause__, StepFailedError)
    assert within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"])) == clean[False]["a"]
    assert_no_leak(llm)


def test_an_abort_that_raises_when_a_stream_closes_leaves_the_loop_serving(llm, clean, monkeypatch):
    fail(monkeypatch, llm.engine, "abort_request")
    stream = llm.generate_stream(PROMPTS["b"], greedy(3000))
    within(WATCHDOG_S, lambda: next(stream))
    stream.close()
    assert within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"])) == clean[False]["a"]
    assert not llm.loop.is_dead


def test_an_abort_that_raises_while_cleaning_up_a_failed_step_kills_the_loop_and_says_so(llm, monkeypatch):
    waiting = iter(llm.loop.submit(PROMPTS["b"], greedy(3000)))
    within(WATCHDOG_S, lambda: next(waiting))
    fail(monkeypatch, llm.engine.runner, "forward")
    fail(monkeypatch, llm.engine, "abort_request", times=10**9)
    with pytest.raises(EngineDeadError, match="state is unknown"):
        within(WATCHDOG_S, lambda: list(waiting))
    assert_dead(llm)


def test_commands_that_raise_reach_their_caller_and_the_loop_serves_on(llm, clean, monkeypatch):
    with pytest.raises(ZeroDivisionError):
        within(WATCHDOG_S, lambda: llm.loop.run_on_loop(lambda engine: 1 // 0))
    fail(monkeypatch, llm.engine, "add_request")
    with pytest.raises(RuntimeError, match="injected fault in add_request"):
        within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"]))
    assert within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"])) == clean[False]["a"]
    assert_no_leak(llm)


@pytest.mark.parametrize("abort_too", [False, True], ids=["abort-works", "abort-raises"])
def test_a_consumer_callback_that_raises_ends_only_its_request(llm, clean, monkeypatch, abort_too):
    calls = []

    def broken_consumer(out):
        calls.append(out)
        raise InjectedFault("injected fault in a consumer")

    if abort_too:
        fail(monkeypatch, llm.engine, "abort_request")
    llm.loop.submit(PROMPTS["b"], greedy(4), on_output=broken_consumer)
    assert within(WATCHDOG_S, lambda: generate(llm, PROMPTS["a"])) == clean[False]["a"]
    assert len(calls) == 1                              # treated as gone after it failed
    assert_no_leak(llm)                                 # b aborted, or (the abort failed) run out


def test_an_error_escaping_the_loops_body_kills_it_and_every_caller_hears(llm, monkeypatch):
    stream = llm.generate_stream(PROMPTS["b"], greedy(3000))
    within(WATCHDOG_S, lambda: next(stream))
    fail(monkeypatch, llm.engine, "has_unfinished_requests", times=10**9)
    with pytest.raises(EngineDeadError, match="injected"):
        within(WATCHDOG_S, lambda: list(stream))
    assert_dead(llm)


def test_callers_do_not_wait_on_a_loop_thread_that_ended_without_a_word(llm, monkeypatch):
    monkeypatch.setattr(llm.loop, "_die", lambda cause: None)   # no consumer is told anything
    stream = llm.generate_stream(PROMPTS["b"], greedy(3000))
    within(WATCHDOG_S, lambda: next(stream))
    fail(monkeypatch, llm.engine, "has_unfinished_requests", times=10**9)
    with pytest.raises(EngineDeadError, match="thread has ended"):
        within(WATCHDOG_S, lambda: list(stream))
    assert_dead(llm)
