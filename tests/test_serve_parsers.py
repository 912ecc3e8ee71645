"""The chat output parser (reasoning + Qwen tool calls) on scripted outputs: fed whole, or cut
at every token boundary, the reasoning, content and tool calls are the same."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine.serve.chat_output_parser import ChatOutputParser

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c\\"}"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "add", "arguments": {"a": [1, {"b": 2}], "c": "x"}}\n</tool_call>'

SCRIPTS = {
    "plain": ("no tags at all < > </ <t", dict()),
    "think then content": ("<think>\nLet me think.\n</think>\n\nThe answer is 4.", dict()),
    "starts in think": ("I reason here.\n</think>\n\nDone.", dict(starts_in_reasoning=True)),
    "think cut by max_tokens": ("still thinking </thi", dict(starts_in_reasoning=True)),
    "tool call": ("Let me check.\n\n" + CALL, dict()),
    "two tool calls": (CALL + "\n" + CALL2, dict()),
    "tool call inside think": ("hmm " + CALL + " more thought</think>ok", dict(starts_in_reasoning=True)),
    "not a call": ("<tool_call>not json</tool_call> after", dict()),
    "call in another shape": ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', dict()),
    "call cut off": ('<tool_call>\n{"name": "f", "arguments": {"x": [1, 2', dict()),
    "call cut before its header": ('<tool_call>\n{"name": "f"', dict()),
    "bad escape in the name": ('<tool_call>{"name": "a\\qb", "arguments": {}}</tool_call>', dict()),
}


def parse(pieces, **kw):
    parser = ChatOutputParser(reasoning=True, tools=True, **kw)
    reasoning, content, calls = "", "", {}
    for part in [parser.feed(p) for p in pieces] + [parser.finish()]:
        reasoning += part.reasoning
        content += part.content
        for piece in part.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls, "a call's header goes out once"
                calls[piece.index] = {"name": piece.name, "arguments": ""}
            calls[piece.index]["arguments"] += piece.arguments
    return reasoning, content, [calls[i] for i in sorted(calls)]


def test_whole_outputs_parse_as_expected():
    assert parse([SCRIPTS["think then content"][0]]) == ("\nLet me think.\n", "\n\nThe answer is 4.", [])
    assert parse(["I reason", "</think>x"], starts_in_reasoning=True) == ("I reason", "x", [])
    reasoning, content, _ = parse([SCRIPTS["think cut by max_tokens"][0]], starts_in_reasoning=True)
    assert (reasoning, content) == ("still thinking </thi", "")
    _, content, calls = parse([SCRIPTS["tool call"][0]])
    assert content == "Let me check.\n\n"
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c\\"}"}'}]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": 'c"}'}
    _, _, calls = parse([SCRIPTS["two tool calls"][0]])
    assert [c["name"] for c in calls] == ["get_weather", "add"]
    assert json.loads(calls[1]["arguments"]) == {"a": [1, {"b": 2}], "c": "x"}
    reasoning, content, calls = parse([SCRIPTS["tool call inside think"][0]], starts_in_reasoning=True)
    assert (reasoning, content, calls[0]["name"]) == ("hmm  more thought", "ok", "get_weather")
    assert parse([SCRIPTS["not a call"][0]]) == ("", "<tool_call>not json</tool_call> after", [])
    assert parse([SCRIPTS["call in another shape"][0]])[2] == [{"name": "f", "arguments": '{"x": 1}'}]
    assert parse([SCRIPTS["call cut off"][0]])[2] == [{"name": "f", "arguments": "{\"x\": [1, 2"}]
    assert parse([SCRIPTS["call cut before its header"][0]]) == ("", '<tool_call>\n{"name": "f"', [])


def test_every_single_cut_gives_the_whole_result():
    for name, (text, kw) in SCRIPTS.items():
        whole = parse([text], **kw)
        for cut in range(len(text) + 1):
            assert parse([text[:cut], text[cut:]], **kw) == whole, (name, cut)
        assert parse(list(text), **kw) == whole, name   # one character at a time


@st.composite
def cut_script(draw):
    text, kw = SCRIPTS[draw(st.sampled_from(sorted(SCRIPTS)))]
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    bounds = [0, *cuts, len(text)]
    return text, kw, [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(cut_script())
def test_any_cuts_give_the_whole_result(case):
    text, kw, pieces = case
    assert parse(pieces, **kw) == parse([text], **kw)


FRAGMENTS = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", "<", "</", "<t", "{",
                             '{"name": "f", "arguments": ', '{"k": "v}"}', "}", '"', "\\", "\n", "a", " "])


@settings(max_examples=300, deadline=None)
@given(st.lists(FRAGMENTS, max_size=20), st.booleans(), st.data())
def test_random_tag_soup_is_cut_invariant(fragments, starts_in_reasoning, data):
    text = "".join(fragments)
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    assert parse(pieces, starts_in_reasoning=starts_in_reasoning) == parse([text], starts_in_reasoning=starts_in_reasoning)


def test_tool_calls_off_leaves_the_tags_in_content():
    parser = ChatOutputParser(reasoning=False, tools=False)
    part = parser.feed(CALL + "<think>x</think>")
    assert part.content == CALL + "<think>x</think>" and not part.tool_calls
