"""One Qwen tool call's body, `{"name": ..., "arguments": {...}}`, streamed as it is generated
(`"parameters"` for `"arguments"` too: the shape tool_choice "required" constrains, tool_choice.py).

Qwen3 / Qwen3.5 chat templates ask the model for `<tool_call>\n{json}\n</tool_call>`; the
chat output parser hands this class the text between the tags. Once the name is complete and
the first character of the arguments value has arrived, the call's header (name) goes out and
every later character of the arguments value is streamed as it comes: its end is found by
tracking JSON nesting and strings, so nothing past the value (the object's closing brace) is
ever sent. A body in another shape is parsed whole at the closing tag. Either way the joined
argument deltas equal what parsing the whole body gives.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# The name complete, then `"arguments":` and the value's first character (the lookahead),
# so that a prefix of the body matches exactly where the whole body would.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass
class ToolCallDelta:
    """What one feed added to the call: the name once (with the header), then argument text."""

    name: str | None = None
    arguments: str = ""


class ToolCallBody:
    def __init__(self):
        self.body = ""
        self.name: str | None = None     # set when the header has gone out
        self._scanned = 0                    # body[:_scanned] has been through the scanner
        self._value_end: int | None = None   # index in body just past the arguments value
        self._scan = ValueScanner()

    def feed(self, text: str) -> ToolCallDelta | None:
        self.body += text
        if self.name is None:
            m = _HEADER.match(self.body)
            if m is None:
                return None
            self.name = _json_string(m.group(1))
            self._scanned = m.end()
            return ToolCallDelta(self.name, self._advance())
        args = self._advance()
        return ToolCallDelta(arguments=args) if args else None

    def close(self) -> ToolCallDelta | None:
        """At `</tool_call>`: a body that never showed the streamed shape is parsed whole; None
        when it is not a JSON object with a string "name" (the caller keeps it as text)."""
        if self.name is not None:
            return None
        try:
            call = json.loads(self.body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        self.name = call["name"]
        return ToolCallDelta(self.name, arguments if isinstance(arguments, str)
                             else json.dumps(arguments, ensure_ascii=False))

    @property
    def started(self) -> bool:
        return self.name is not None

    def _advance(self) -> str:
        """The argument characters that arrived since the last call, up to the value's end."""
        if self._value_end is not None:
            return ""
        start = self._scanned
        for i in range(start, len(self.body)):
            if self._scan.push(self.body[i]):
                self._value_end = i   # this character is past the value
                self._scanned = i
                return self.body[start:i]
        self._scanned = len(self.body)
        return self.body[start:]


def _json_string(escaped: str) -> str:
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:   # an invalid escape: the name as the model wrote it
        return escaped


class ValueScanner:
    """Finds where a JSON value ends, one character at a time: push() is True for the first
    character that is not part of the value."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.started = False
        self.done = False

    def push(self, ch: str) -> bool:
        if self.done:
            return True
        if not self.started:
            self.started = True
            if ch in "{[":
                self.depth = 1
            elif ch == '"':
                self.in_string = True
            return False
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif ch == "\\":
                self.escaped = True
            elif ch == '"':
                self.in_string = False
                if self.depth == 0:       # a string value: its closing quote is its end
                    self.done = True
                    return False
            return False
        if self.depth == 0:               # a number / true / false / null runs to a delimiter
            if ch in ",}] \t\r\n":
                self.done = True
                return True
            return False
        if ch == '"':
            self.in_string = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 0:
                self.done = True   # the closing bracket still belongs to the value
        return False
