"""Splits a chat model's output, as it streams, into reasoning, content and tool calls.

Qwen3 / Qwen3.5 outputs look like `<think>\\n...\\n</think>\\n\\ncontent` and call tools with
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. With thinking on, the
template opens the think block itself, so the output starts inside it (`starts_in_reasoning`).

The parser is a small state machine over three modes: reasoning, content and a tool call. A
tag is recognised only in the modes where it means something (`</think>` in reasoning,
`<tool_call>` in both others, `</tool_call>` inside a call), and text that may be the start
of such a tag is held back until the next characters decide. So the deltas are the same
however the text is cut: feeding it whole or token by token gives the same reasoning,
content and calls. A tool call inside a think block is a tool call; afterwards the parser is
back in the think block. A think block cut off by max_tokens stays reasoning: its end tag
never shows up in content, and held-back text is released as text of the mode it is in.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .tool_calls import ToolCallBody

THINK_START, THINK_END = "<think>", "</think>"
TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"

REASONING, CONTENT, TOOL = "reasoning", "content", "tool_call"


@dataclass
class ToolCallPiece:
    index: int
    id: str | None = None       # with the header (first piece of a call) only
    name: str | None = None
    arguments: str = ""


@dataclass
class ChatDeltaParts:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallPiece] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutputParser:
    def __init__(self, reasoning: bool, tools: bool, starts_in_reasoning: bool = False):
        self.reasoning, self.tools = reasoning, tools
        self.mode = REASONING if reasoning and starts_in_reasoning else CONTENT
        self._outer = self.mode                 # the mode a tool call returns to
        self._held = ""
        self._call: ToolCallBody | None = None
        self.num_tool_calls = 0

    def _tags(self) -> tuple[str, ...]:
        if self.mode == TOOL:
            return (TOOL_END,)
        tags = []
        if self.reasoning:
            tags.append(THINK_END if self.mode == REASONING else THINK_START)
        if self.tools:
            tags.append(TOOL_START)
        return tuple(tags)

    def feed(self, text: str) -> ChatDeltaParts:
        out = ChatDeltaParts()
        buf, self._held = self._held + text, ""
        while buf:
            tags = self._tags()
            hits = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
            if hits:
                i, tag = min(hits)
                self._emit(buf[:i], out)
                self._switch(tag, out)
                buf = buf[i + len(tag):]
                continue
            keep = _partial_tag_suffix(buf, tags)
            self._emit(buf[:len(buf) - keep], out)
            self._held = buf[len(buf) - keep:]
            break
        return out

    def finish(self) -> ChatDeltaParts:
        """The end of the output: held-back text is text of the current mode; an open tool
        call that never streamed its header is kept as the text it was."""
        out = ChatDeltaParts()
        held, self._held = self._held, ""
        self._emit(held, out)
        if self.mode == TOOL and not self._call.started:
            self._emit_text(TOOL_START + self._call.body, self._outer, out)
        return out

    def _emit(self, text: str, out: ChatDeltaParts) -> None:
        if not text:
            return
        if self.mode == TOOL:
            delta = self._call.feed(text)
            if delta is not None:
                out.tool_calls.append(self._piece(delta))
        else:
            self._emit_text(text, self.mode, out)

    @staticmethod
    def _emit_text(text: str, mode: str, out: ChatDeltaParts) -> None:
        if mode == REASONING:
            out.reasoning += text
        else:
            out.content += text

    def _switch(self, tag: str, out: ChatDeltaParts) -> None:
        if tag == THINK_START:
            self.mode = REASONING
        elif tag == THINK_END:
            self.mode = CONTENT
        elif tag == TOOL_START:
            self._outer, self.mode = self.mode, TOOL
            self._call = ToolCallBody()
        else:   # TOOL_END
            delta = self._call.close()
            if delta is not None:
                out.tool_calls.append(self._piece(delta))
            elif not self._call.started:   # not a call after all: keep the text
                self._emit_text(TOOL_START + self._call.body + TOOL_END, self._outer, out)
            if self._call.started:
                self.num_tool_calls += 1
            self.mode, self._call = self._outer, None

    def _piece(self, delta) -> ToolCallPiece:
        if delta.name is not None:
            return ToolCallPiece(self.num_tool_calls, new_call_id(), delta.name, delta.arguments)
        return ToolCallPiece(self.num_tool_calls, arguments=delta.arguments)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _partial_tag_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper prefix of one of `tags`."""
    for n in range(min(len(text), max((len(t) for t in tags), default=1) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0
