"""Structured outputs through the server (serve/structured.py, serve/tool_choice.py) with the real
openai client, on the embedded default model: response_format, vLLM's structured_outputs and
guided_* on both endpoints, tool_choice "required" and a named function, and the 400s.

The default model is tiny and trained on Python source: sampled at temperature 1.0 it rambles,
so the schemas bound their strings and numbers, and each request has a seed whose output
completes its structure within max_tokens (finish_reason "stop", or "tool_calls")."""

import asyncio
import json
import re
from types import SimpleNamespace

import httpx
import jsonschema
import openai
import pydantic
import pytest

from chat_checkpoint import REASONING, make_chat_checkpoint
from hybrid_engine import LLM
from hybrid_engine.prompt import PreparedPrompt
from hybrid_engine.serve.chat_output_parser import ChatOutputParser
from hybrid_engine.serve.errors import APIError
from hybrid_engine.serve.protocol import Tool
from hybrid_engine.serve.tool_choice import ForcedToolCallParser, forced_calls
from serve_support import client, running_server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 12}}}}},
    {"type": "function", "function": {"name": "add", "description": "The sum of two numbers.", "parameters": {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                       "b": {"type": "integer", "minimum": 0, "maximum": 99}}}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SAMPLED = dict(temperature=1.0, max_tokens=250)


@pytest.fixture(scope="module")
def served():
    """The default model's LLM, its server and an openai client of the server."""
    llm = LLM(max_num_seqs=8, max_model_len=512)
    with running_server(llm) as server:
        yield SimpleNamespace(llm=llm, server=server, api=client(server))
    llm.shutdown()


@pytest.fixture
def llm(served):
    return served.llm


@pytest.fixture
def server(served):
    return served.server


@pytest.fixture
def api(served):
    return served.api


def chat(api, seed=1, **kw):
    return api.chat.completions.create(model="default", messages=MESSAGES, seed=seed, **{**SAMPLED, **kw})


def complete(api, seed=1, **kw):
    return api.completions.create(model="default", prompt="def person():\n    return ", seed=seed, **{**SAMPLED, **kw})


def chat_stream_text(api, **kw) -> tuple[dict[int, str], dict[int, str]]:
    texts, finish = {}, {}
    for chunk in chat(api, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    return texts, finish


def test_chat_json_schema_validates_streamed_and_not(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = chat(api, n=3, response_format=fmt)
    assert len(r.choices) == 3
    for c in r.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), PERSON)
    assert len({c.message.content for c in r.choices}) > 1   # three samples, not one
    texts, finish = chat_stream_text(api, n=3, response_format=fmt)
    assert sorted(texts) == [0, 1, 2] and set(finish.values()) == {"stop"}
    assert [texts[i] for i in range(3)] == [c.message.content for c in r.choices]   # same seeds, same samples
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_completions_json_schema_validates_streamed_and_not(api):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    r = complete(api, n=3, extra_body={"response_format": fmt})
    for c in r.choices:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), PERSON)
    texts, finish = {}, {}
    for chunk in complete(api, n=3, stream=True, extra_body={"response_format": fmt}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert set(finish.values()) == {"stop"}
    assert [texts[i] for i in range(3)] == [c.text for c in r.choices]
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_is_a_json_object(api):
    r = chat(api, seed=3, n=2, response_format={"type": "json_object"})
    for c in r.choices:
        assert c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict)
    r = complete(api, seed=3, extra_body={"response_format": {"type": "json_object"}})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].text), dict)
    text = chat(api, seed=3, max_tokens=12, response_format={"type": "text"}).choices[0].message.content
    assert text == chat(api, seed=3, max_tokens=12).choices[0].message.content   # "text": unconstrained


@pytest.mark.parametrize("field, value, check", [
    ("guided_regex", r"[a-z]{3,8}-[0-9]{2}", lambda t: re.fullmatch(r"[a-z]{3,8}-[0-9]{2}", t)),
    ("guided_choice", ["yes", "no", "maybe"], lambda t: t in ("yes", "no", "maybe")),
    ("guided_grammar", 'root ::= "x = " [0-9] [0-9]? [0-9]? ("," " "? [0-9])?',
     lambda t: re.fullmatch(r"x = [0-9]{1,3}(, ?[0-9])?", t)),
    ("guided_json", json.dumps(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_guided_fields_on_both_endpoints(api, field, value, check):
    for seed in (1, 2):
        text = complete(api, seed=seed, extra_body={field: value}).choices[0].text
        assert check(text), (field, text)
        text = chat(api, seed=seed, extra_body={field: value}).choices[0].message.content
        assert check(text), (field, text)


@pytest.mark.parametrize("constraint, check", [
    ({"regex": r"(true|false|None)"}, lambda t: t in ("true", "false", "None")),
    ({"choice": ["red", "green"]}, lambda t: t in ("red", "green")),
    ({"grammar": 'root ::= "def " [a-z]+ "():"', "disable_any_whitespace": True},
     lambda t: re.fullmatch(r"def [a-z]+\(\):", t)),
    ({"json": PERSON, "disable_any_whitespace": True},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None and " :" not in t and "\n" not in t),
])
def test_structured_outputs_extra_body(api, constraint, check):
    r = chat(api, n=2, extra_body={"structured_outputs": constraint})
    for c in r.choices:
        assert c.finish_reason == "stop" and check(c.message.content), c.message.content
    r = complete(api, extra_body={"structured_outputs": constraint})
    assert r.choices[0].finish_reason == "stop" and check(r.choices[0].text), r.choices[0].text


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    population: int = pydantic.Field(ge=0, le=100000)
    coastal: bool


def test_openai_parse_returns_the_pydantic_model(api):
    r = api.chat.completions.parse(model="default", messages=MESSAGES, response_format=City, seed=1, **SAMPLED)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 100000 and len(city.name) <= 12
    assert City.model_validate_json(r.choices[0].message.content) == city


def stream_calls(stream) -> tuple[list[dict], str | None, str]:
    calls, finish, content = {}, None, ""
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                if t.id is not None:
                    assert t.index not in calls and t.type == "function"
                    calls[t.index] = {"name": t.function.name, "arguments": ""}
                calls[t.index]["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
    return [calls[i] for i in sorted(calls)], finish, content


def check_calls(calls, names=tuple(PARAMETERS)):
    assert calls
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), PARAMETERS[call["name"]])


@pytest.mark.parametrize("tool_choice, names", [
    ("required", tuple(PARAMETERS)),
    ({"type": "function", "function": {"name": "get_weather"}}, ("get_weather",)),
    ({"type": "function", "function": {"name": "add"}}, ("add",)),
])
def test_tool_choice_forces_valid_calls(api, tool_choice, names):
    for seed in (1, 2):
        kw = dict(seed=seed, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
        r = chat(api, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
        assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
        check_calls(calls, names)
        streamed, finish, content = stream_calls(chat(api, stream=True, **kw))
        assert (streamed, finish, content) == (calls, "tool_calls", "")


def test_tool_choice_required_may_call_more_than_once(api):
    kw = dict(seed=2, tools=TOOLS, tool_choice="required", max_tokens=300)   # seed 2: both tools, in one array
    choice = chat(api, **kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls]
    assert [c["name"] for c in calls] == ["add", "get_weather"]
    check_calls(calls)
    assert len({c.id for c in choice.message.tool_calls}) == 2
    assert stream_calls(chat(api, stream=True, **kw)) == (calls, "tool_calls", "")


def fold(parser, text: str, size: int) -> tuple[list[tuple[str, str]], str]:
    """The (name, arguments) calls and the content the parser makes of text fed `size` characters at a time."""
    calls, content = {}, ""
    for parts in [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]:
        content += parts.content
        for piece in parts.tool_calls:
            if piece.id is not None:
                calls[piece.index] = [piece.name, ""]
            calls[piece.index][1] += piece.arguments
    return [tuple(calls[i]) for i in sorted(calls)], content


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_forced_calls_parse_the_same_however_the_output_is_cut(size):
    # a string holding brackets and an escaped quote, nested objects, free whitespace between calls
    add = '{"a": 1, "b": {"x": "}]\\"}"}}'
    text = ' [ {"name": "add", "parameters": ' + add + '} ,\n{"name":"get_weather","parameters":{"city":"P"}} ]'
    parser = ForcedToolCallParser(ChatOutputParser(False, False), None)
    assert fold(parser, text, size) == ([("add", add), ("get_weather", '{"city":"P"}')], "")
    parser = ForcedToolCallParser(ChatOutputParser(False, False), "add")
    assert fold(parser, '{"a": 1}', size) == ([("add", '{"a": 1}')], "")
    # cut by max_tokens before a call's name: nothing was a call, the text comes back as content
    parser = ForcedToolCallParser(ChatOutputParser(False, False), None)
    assert fold(parser, '[ {"na', size) == ([], '[ {"na')


def test_required_lifts_the_tools_defs_to_the_top():
    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {key: {"$ref": "#/$defs/Loc"}}, "required": [key], "$defs": {"Loc": loc}}}})
        for name, key in (("go", "to"), ("stay", "at"))]
    schema = forced_calls(tools, "required").schema
    assert schema["$defs"] == {"Loc": loc} and "$defs" in tools[0].function.parameters   # the request's own untouched
    jsonschema.validate([{"name": "go", "parameters": {"to": {"city": "P"}}}, {"name": "stay", "parameters": {
        "at": {"city": "Q"}}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"to": {"city": 3}}}], schema)
    tools[1].function.parameters["$defs"]["Loc"] = {"type": "string"}
    with pytest.raises(APIError, match="another tool defines 'Loc' differently") as e:
        forced_calls(tools, "required")
    assert e.value.param == "tools[1].function.parameters.$defs.Loc"


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


CHAT = {"model": "default", "messages": MESSAGES, "max_tokens": 8}
COMPLETION = {"model": "default", "prompt": "x", "max_tokens": 8}


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format.json_schema.schema", ["nonsense"]),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
     "response_format.json_schema.schema", ["required"]),
    ("/v1/completions", {**COMPLETION, "guided_regex": "[a-z"}, "guided_regex", ["not valid"]),
    ("/v1/chat/completions", {**CHAT, "guided_json": "{not json"}, "guided_json", ["not JSON"]),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"grammar": "root ::= ("}},
     "structured_outputs.grammar", ["EBNF"]),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs", ["exactly one", "regex", "choice"]),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"whitespace_pattern": " "}},
     "structured_outputs.whitespace_pattern", ["unknown field"]),
    ("/v1/chat/completions", {**CHAT, "guided_regex": "a+", "response_format": {"type": "json_object"}},
     "response_format", ["response_format and guided_regex", "one way"]),
    ("/v1/completions", {**COMPLETION, "guided_choice": ["a"], "structured_outputs": {"regex": "a"}},
     "structured_outputs", ["structured_outputs and guided_choice"]),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": "required", "guided_regex": "a"},
     "guided_regex", ["guided_regex and tool_choice"]),
    ("/v1/completions", {**COMPLETION, "guided_regex": "a", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend", ["xgrammar"]),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, "tool_choice", ["\"required\"", "needs tools"]),
    ("/v1/chat/completions", {**CHAT, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", ["'f'", "not among", "get_weather"]),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 7}}}}}], "tool_choice": "required"},
     "tools[0].function.parameters", ["JSON schema"]),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "sometimes"}, "tool_choice", ["'required'", "got 'sometimes'"]),
])
def test_bad_constraints_are_400s_naming_the_field(server, path, body, param, words):
    r = _post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["code"] == 400 and param in error["message"]
    for word in words:
        assert word in error["message"], error["message"]


def test_constrained_requests_are_prepared_off_the_event_loop(llm, api, monkeypatch):
    # A constrained request's first prepare builds xgrammar's vocabulary tables (0.9 s for
    # Qwen3.5's): on the event loop it would stall every other client.
    on_event_loop, prepare = [], llm.engine.prepare

    def recording_prepare(prompt, params=None):
        if not isinstance(prompt, PreparedPrompt):   # a prepared one is handed on as it is
            try:
                asyncio.get_running_loop()
                on_event_loop.append(True)
            except RuntimeError:
                on_event_loop.append(False)
        return prepare(prompt, params)
    monkeypatch.setattr(llm.engine, "prepare", recording_prepare)
    r = complete(api, n=2, extra_body={"guided_choice": ["ok", "fine"]})
    assert {c.text for c in r.choices} <= {"ok", "fine"}
    assert on_event_loop == [False, False]


def test_the_server_serves_on_after_a_bad_constraint(server, api):
    assert _post(server, "/v1/completions", {**COMPLETION, "guided_json": {"type": "nonsense"}}).status_code == 400
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        complete(api, extra_body={"guided_regex": "("})
    r = complete(api, extra_body={"guided_choice": ["ok", "fine"]})
    assert r.choices[0].text in ("ok", "fine") and r.choices[0].finish_reason == "stop"


@pytest.fixture(scope="module")
def thinking_api(tmp_path_factory):
    """A checkpoint whose template opens a think block (tests/support/chat_checkpoint.py): the
    engine constrains only after its `</think>`, and the reasoning stays reasoning_content."""
    llm = LLM(model=str(make_chat_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt")), max_num_seqs=4)
    with running_server(llm, model_name="chat") as s:
        yield client(s)
    llm.shutdown()


def test_a_constraint_starts_after_the_think_block(thinking_api):
    def create(**kw):
        return thinking_api.chat.completions.create(
            model="chat", messages=MESSAGES, temperature=0, max_tokens=60,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}, **kw.pop("extra_body", {})}, **kw)
    r = create(extra_body={"guided_choice": ["yes", "no"]})
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == REASONING and message.content in ("yes", "no")
    tools = [{"type": "function", "function": {"name": "ping"}}]   # no parameters: {} is its only call
    kw = dict(tools=tools, tool_choice={"type": "function", "function": {"name": "ping"}})
    r = create(**kw)
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert (call.function.name, json.loads(call.function.arguments)) == ("ping", {})
    assert r.choices[0].message.model_extra["reasoning_content"] == REASONING
    streamed, finish, content = stream_calls(create(stream=True, **kw))
    assert (streamed, finish, content) == ([{"name": "ping", "arguments": call.function.arguments}], "tool_calls", "")
