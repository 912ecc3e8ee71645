"""Stop rules and streamed text on the embedded default model: streamed deltas always join to the
final text (a stop string is held back while it may still complete), min_tokens holds for stop
strings too, and a stop token's text stays out of `text` unless include_stop_str_in_output."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.sampling_params import MAX_STOP_STRINGS

from engine_checks import assert_no_leak

PROMPT = "def read_config(path):\n"


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32")


@pytest.fixture(scope="module")
def greedy(llm):
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0]


def streamed(llm, prompt, params) -> tuple[str, object]:
    text, last = "", None
    for last in llm.generate_stream(prompt, params):
        text += last.new_text
    return text, last


def test_deltas_never_overshoot_a_stop_string(llm):
    """The issue's case: the final text is '    \"\"\"Retur' and the deltas used to join to
    '    \"\"\"Return'."""
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["n a"])
    text, last = streamed(llm, PROMPT, params)
    assert last.finish_reason == "stop" and last.stop_reason == "n a"
    assert text == last.text == llm.generate(PROMPT, params, use_tqdm=False)[0].text
    assert_no_leak(llm.engine)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_joined_deltas_equal_the_final_text_for_stop_strings_cut_from_the_output(llm, greedy, data):
    full = greedy.text
    stops = []
    for _ in range(data.draw(st.integers(1, 3), label="number of stops")):
        start = data.draw(st.integers(0, len(full) - 1), label="start")
        length = data.draw(st.integers(1, min(6, len(full) - start)), label="length")
        stops.append(full[start:start + length])
    include = data.draw(st.booleans(), label="include_stop_str_in_output")
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=stops, include_stop_str_in_output=include)
    text, last = streamed(llm, PROMPT, params)
    assert text == last.text
    assert last.finish_reason == "stop" and last.stop_reason in stops       # cut from the output: it must hit
    i = full.find(last.stop_reason)
    assert last.text == full[:i + len(last.stop_reason) if include else i]
    assert_no_leak(llm.engine)


def test_the_most_stop_strings_allowed_stop_and_stream_as_one_does(llm, greedy):
    """Issue 37's cap: MAX_STOP_STRINGS stops, all but one absent from the output and most of
    them sharing the present one's start (so their prefixes are held back while streaming)."""
    full = greedy.text
    real = full[20:24]
    decoys = [real[:i % len(real)] + f"\x01{i}" for i in range(MAX_STOP_STRINGS - 1)]
    assert not any(d in full for d in decoys) and len(set(decoys)) == len(decoys)
    for include in (False, True):
        params = SamplingParams(temperature=0.0, max_tokens=40, stop=decoys + [real],
                                include_stop_str_in_output=include)
        text, last = streamed(llm, PROMPT, params)
        i = full.find(real)
        assert last.finish_reason == "stop" and last.stop_reason == real
        assert text == last.text == full[:i + len(real) if include else i]
    assert_no_leak(llm.engine)


def test_more_stop_strings_than_allowed_are_refused(llm):
    with pytest.raises(ValueError, match=f"stop must hold at most {MAX_STOP_STRINGS} strings, got 10000"):
        llm.generate(PROMPT, SamplingParams(max_tokens=4, stop=[f"<{i}>" for i in range(10_000)]), use_tqdm=False)
    assert_no_leak(llm.engine)


def test_min_tokens_applies_to_stop_strings(llm):
    """Issue 17 item 4: this returned 2 tokens."""
    out = llm.generate("def f(x):", SamplingParams(temperature=0.0, max_tokens=12, min_tokens=8, stop=[":"]),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= 8
    if out.finish_reason == "stop":
        assert out.stop_reason == ":" and not out.text.endswith(":")


def test_a_stop_token_leaves_its_text_out_unless_asked(llm, greedy):
    """Issue 17 item 7 (vLLM's behaviour): token_ids keep the stop token, text drops it."""
    tok = llm.tokenizer
    ids = greedy.token_ids
    # the first token with visible text that is not the first one
    j = next(i for i in range(1, len(ids)) if tok.decode([ids[i]]).strip() and ids[i] not in ids[:i])
    base = dict(temperature=0.0, max_tokens=40, stop_token_ids=[ids[j]])
    dropped = llm.generate(PROMPT, SamplingParams(**base), use_tqdm=False)[0]
    kept = llm.generate(PROMPT, SamplingParams(**base, include_stop_str_in_output=True), use_tqdm=False)[0]
    assert dropped.token_ids == kept.token_ids == ids[:j + 1]
    assert dropped.finish_reason == "stop" and dropped.stop_reason == ids[j]
    assert dropped.text == tok.decode(ids[:j], skip_special_tokens=True)
    assert kept.text == tok.decode(ids[:j + 1], skip_special_tokens=True) != dropped.text
    text, last = streamed(llm, PROMPT, SamplingParams(**base))
    assert text == last.text == dropped.text


def test_include_stop_str_in_output_must_be_a_bool(llm):
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        llm.generate(PROMPT, SamplingParams(include_stop_str_in_output="yes"), use_tqdm=False)
