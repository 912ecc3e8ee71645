"""Reasoning and tool calls end to end through /v1/chat/completions, on a checkpoint whose
template renders tools and `enable_thinking`, and whose greedy output is a scripted think
block and tool call (tests/support/chat_checkpoint.py)."""

import httpx
import pytest

from chat_checkpoint import CONTENT, REASONING, TOOL_ARGUMENTS, TOOL_NAME, make_chat_checkpoint
from hybrid_engine import LLM
from serve_support import client, running_server

TOOLS = [{"type": "function", "function": {
    "name": TOOL_NAME, "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}}}}}]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    llm = LLM(model=str(make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")), max_num_seqs=4)
    with running_server(llm, model_name="chat") as s:
        yield s
    llm.shutdown()


@pytest.fixture(scope="module")
def api(server):
    return client(server)


def create(api, **kw):
    return api.chat.completions.create(model="chat", messages=MESSAGES, temperature=0, max_tokens=20, **kw)


def streamed(api, **kw):
    """The stream folded back into (role, reasoning, content, tool calls, finish reason)."""
    role, reasoning, content, calls, finish = None, "", "", {}, None
    for chunk in create(api, stream=True, **kw):
        for c in chunk.choices:
            d = c.delta
            role = role or d.role
            reasoning += (d.model_extra or {}).get("reasoning_content") or ""
            content += d.content or ""
            for t in d.tool_calls or []:
                if t.id is not None:
                    assert t.index not in calls and t.type == "function"
                    calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                calls[t.index]["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return role, reasoning, content, [calls[i] for i in sorted(calls)], finish


def test_tools_reach_the_template(server):
    with_tools = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES, "tools": TOOLS}).json()
    without = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert with_tools["count"] > without["count"]
    text = httpx.post(server.url + "/detokenize", json={"tokens": with_tools["tokens"]}).json()["prompt"]
    assert '"name": "get_weather"' in text and "The weather in a city." in text


def test_tool_call_parsed_from_the_output(api):
    r = create(api, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == CONTENT
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", TOOL_NAME, TOOL_ARGUMENTS)
    assert call.id.startswith("call_")
    role, reasoning, content, calls, finish = streamed(api, tools=TOOLS)
    assert (role, reasoning, content, finish) == ("assistant", "", CONTENT, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(TOOL_NAME, TOOL_ARGUMENTS)]


def test_without_tools_the_call_stays_text(api):
    r = create(api)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls in (None, [])
    assert r.choices[0].message.content.startswith(CONTENT + "<tool_call>")


def test_thinking_goes_to_reasoning_content(api):
    kw = dict(tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = create(api, **kw)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content == CONTENT and message.tool_calls[0].function.arguments == TOOL_ARGUMENTS
    assert r.choices[0].finish_reason == "tool_calls"
    _, reasoning, content, calls, finish = streamed(api, **kw)
    assert (reasoning, content, finish) == (REASONING, CONTENT, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [(TOOL_NAME, TOOL_ARGUMENTS)]


@pytest.mark.parametrize("max_tokens", [1, 2])
def test_a_think_block_cut_by_max_tokens_never_leaks_into_content(api, max_tokens):
    # 1 token: the reasoning only; 2 tokens: the end tag too, and nothing after it
    kw = dict(max_tokens=max_tokens, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    r = api.chat.completions.create(model="chat", messages=MESSAGES, temperature=0, **kw)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert message.model_extra["reasoning_content"] == REASONING
    assert not message.content
    reasoning, content, finish = "", "", None
    for chunk in api.chat.completions.create(model="chat", messages=MESSAGES, temperature=0, stream=True, **kw):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == (REASONING, "", "length")
