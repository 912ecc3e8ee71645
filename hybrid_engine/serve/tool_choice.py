"""tool_choice "required" and a named function: the output constrained to tool calls, vLLM's way.

"required": the output is a JSON array of at least one call, each `{"name": <one of the tools'
names>, "parameters": <that tool's arguments>}` (the items an anyOf with one branch per tool,
the tools' `$defs` lifted to the top, where their `$ref`s point; with parallel_tool_calls false,
OpenAI's "at most one call", exactly one). A named function: the output is the JSON of its
arguments. The schema goes to the engine as the request's structured output
(structured.py); ForcedToolCallParser turns the output back into tool calls as it streams, with
the pieces ChatOutputParser gives for calls the model makes on its own, so chat.py answers both
alike (`tool_calls`, content null, finish_reason "tool_calls").
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from hybrid_engine.structured_outputs import StructuredOutputsParams

from .chat_output_parser import ChatDeltaParts, ChatOutputParser, ToolCallPiece, new_call_id
from .errors import APIError
from .protocol import NamedToolChoice, Tool
from .tool_calls import ToolCallBody, ValueScanner

# A function declared without parameters takes none.
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ForcedCalls:
    function: str | None   # the named function; None for "required" (any of the tools)
    schema: dict           # what the output must satisfy

    def parser(self, text_parser: ChatOutputParser) -> ForcedToolCallParser:
        return ForcedToolCallParser(text_parser, self.function)


def forced_calls(tools: list[Tool] | None, tool_choice, parallel_tool_calls: bool | None = None) -> ForcedCalls | None:
    """None unless tool_choice forces calls; a 400 naming tool_choice when it cannot, or the
    tool whose parameters are not a JSON schema."""
    if tool_choice in (None, "none", "auto"):
        return None
    asked = "\"required\"" if tool_choice == "required" else f"the function {tool_choice.function.name!r}"
    if not tools:
        raise APIError(400, f"tool_choice: {asked} needs tools, and the request gives none", "tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        for i, tool in enumerate(tools):
            if tool.function.name == tool_choice.function.name:
                return ForcedCalls(tool.function.name, _parameters(tool, i))
        names = ", ".join(repr(t.function.name) for t in tools)
        raise APIError(400, f"tool_choice: {asked} is not among the tools ({names})", "tool_choice")
    schema = _any_call_schema(tools)
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    return ForcedCalls(None, schema)


def _parameters(tool: Tool, index: int) -> dict:
    params = copy.deepcopy(NO_PARAMETERS if tool.function.parameters is None else tool.function.parameters)
    field = f"tools[{index}].function.parameters"
    try:
        StructuredOutputsParams(json=params).validate()
    except ValueError as e:
        reason = str(e).removeprefix("structured_outputs.json is not valid: ")
        raise APIError(400, f"{field} is not a JSON schema the output can be held to: {reason}", field) from None
    return params


def _any_call_schema(tools: list[Tool]) -> dict:
    branches, defs = [], {}
    for i, tool in enumerate(tools):
        params = _parameters(tool, i)
        for name, schema in params.pop("$defs", {}).items():
            if defs.setdefault(name, schema) != schema:
                field = f"tools[{i}].function.parameters.$defs.{name}"
                raise APIError(400, f"{field}: another tool defines {name!r} differently; tool_choice "
                                    "\"required\" puts every tool's $defs in one schema", field)
        branches.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                        "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if defs:
        schema["$defs"] = defs
    return schema


class ForcedToolCallParser:
    """ChatOutputParser's feed / finish for a forced output: the reasoning split off by
    `text_parser` (one without tools), the content read as the calls. Output that never became
    a call (cut by max_tokens before a name) comes back as content at the end."""

    def __init__(self, text_parser: ChatOutputParser, function: str | None):
        self.text_parser = text_parser
        self.calls = _NamedCall(function) if function is not None else _CallArray()
        self.content = ""
        self.made_calls = False

    def feed(self, text: str) -> ChatDeltaParts:
        return self._calls(self.text_parser.feed(text))

    def finish(self) -> ChatDeltaParts:
        out = self._calls(self.text_parser.finish())
        if not self.made_calls:
            out.content = self.content
        return out

    def _calls(self, parts: ChatDeltaParts) -> ChatDeltaParts:
        self.content += parts.content
        pieces = self.calls.feed(parts.content) if parts.content else []
        self.made_calls |= bool(pieces)
        return ChatDeltaParts(reasoning=parts.reasoning, tool_calls=pieces)


class _NamedCall:
    """The whole output is the arguments of the one call."""

    def __init__(self, function: str):
        self.function = function
        self.started = False

    def feed(self, text: str) -> list[ToolCallPiece]:
        if self.started:
            return [ToolCallPiece(0, arguments=text)]
        self.started = True
        return [ToolCallPiece(0, new_call_id(), self.function, text)]


class _CallArray:
    """`[{"name": ..., "parameters": {...}}, ...]`: each element a ToolCallBody, fed the
    element's characters as they come (between elements there are only `[`, `,`, `]` and
    whitespace: strings live inside elements)."""

    def __init__(self):
        self.num_calls = 0
        self._call: ToolCallBody | None = None
        self._end: ValueScanner | None = None

    def feed(self, text: str) -> list[ToolCallPiece]:
        pieces, start = [], 0
        for i, ch in enumerate(text):
            if self._call is None:
                if ch == "{":
                    self._call, self._end, start = ToolCallBody(), ValueScanner(), i
                    self._end.push(ch)
                continue
            self._end.push(ch)
            if self._end.done:
                pieces += self._piece(self._call.feed(text[start:i + 1]))
                pieces += self._close()
        if self._call is not None:
            pieces += self._piece(self._call.feed(text[start:]))
        return pieces

    def _close(self) -> list[ToolCallPiece]:
        pieces = self._piece(self._call.close())   # a body whose header never streamed, parsed whole
        if self._call.started:
            self.num_calls += 1
        self._call = self._end = None
        return pieces

    def _piece(self, delta) -> list[ToolCallPiece]:
        if delta is None:
            return []
        if delta.name is not None:
            return [ToolCallPiece(self.num_calls, new_call_id(), delta.name, delta.arguments)]
        return [ToolCallPiece(self.num_calls, arguments=delta.arguments)]
