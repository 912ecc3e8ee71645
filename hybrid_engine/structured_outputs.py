"""SamplingParams(structured_outputs=StructuredOutputsParams(...)): what a request's output must
be, in vLLM's names. Exactly one of json (a JSON schema, as a dict or its text), regex, choice
(a list of strings), grammar (EBNF, xgrammar's dialect of GBNF) or json_object (any JSON
object).

`grammar()` turns it into an xgrammar Grammar: parsing and converting only, which takes
milliseconds and needs no tokenizer, so a bad schema, regex or grammar is a ValueError naming
the problem when the request is prepared, before anything runs. Compiling it against the
vocabulary (the token-mask tables) is the engine's, in a worker thread
(hybrid_engine/grammar_compiler.py).

xgrammar is imported on first use: it costs about 1.5 s, which engines that never see a
constrained request should not pay.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")
WHITESPACE_RUN = 20


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's: JSON with fixed separators only, no free whitespace between its tokens. Otherwise
    # free whitespace is allowed, at most WHITESPACE_RUN characters in a gap (llama.cpp's JSON
    # grammar bounds it alike): unbounded, a sampled model can wander through spaces and
    # newlines until max_tokens cuts the structure short.
    disable_any_whitespace: bool = False

    def kind(self) -> str:
        """Which constraint this is; ValueError unless exactly one is set."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(KINDS)}; got {', '.join(given) if given else 'none'}")
        return given[0]

    def key(self) -> tuple[str, str, bool]:
        """(kind, text, whitespace flag): what the compiled grammar depends on, so what the
        compiler caches it by."""
        kind = self.kind()
        value = getattr(self, kind)
        if kind == "json":
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        elif kind == "choice":
            text = json.dumps(value)
        elif kind == "json_object":
            text = ""
        else:
            text = value
        return kind, text, bool(self.disable_any_whitespace)

    def validate(self) -> None:
        """ValueError naming the field and the problem (the parse the compiler will redo)."""
        self.grammar_object()

    def grammar_object(self):
        """The xgrammar Grammar this constraint stands for; ValueError when it is not one."""
        kind = self.kind()
        value = getattr(self, kind)
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(f"structured_outputs.disable_any_whitespace must be a bool, "
                             f"got {self.disable_any_whitespace!r}")
        import xgrammar as xgr

        try:
            if kind in ("json", "json_object"):
                if kind == "json_object" and value is not True:
                    raise ValueError(f"must be True or None, got {value!r}")
                # json_object: any JSON object (OpenAI's JSON mode), under the same whitespace rule
                schema = _schema_text(value) if kind == "json" else '{"type": "object"}'
                return xgr.Grammar.from_json_schema(
                    schema, any_whitespace=not self.disable_any_whitespace,
                    max_whitespace_cnt=None if self.disable_any_whitespace else WHITESPACE_RUN)
            if kind == "regex":
                if not isinstance(value, str) or not value:
                    raise ValueError(f"must be a non-empty str, got {value!r}")
                return xgr.Grammar.from_regex(value)
            if kind == "choice":
                return xgr.Grammar.from_ebnf(choice_ebnf(value))
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"must be a non-empty EBNF grammar str, got {value!r}")
            return xgr.Grammar.from_ebnf(value)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"structured_outputs.{kind} is not valid: {_reason(e)}") from None


def choice_ebnf(choice) -> str:
    """An EBNF grammar whose sentences are exactly the strings of `choice`."""
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise ValueError(f"must be a non-empty list of non-empty str, got {choice!r}")
    # JSON's string escapes are the ones xgrammar's EBNF literals read.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def _schema_text(schema) -> str:
    if isinstance(schema, dict):
        return json.dumps(schema)
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"the schema is not JSON ({e})") from None
        if not isinstance(parsed, (dict, bool)):
            raise ValueError(f"a JSON schema is an object, got {type(parsed).__name__}")
        return schema
    raise ValueError(f"a JSON schema must be a dict or its JSON text, got {type(schema).__name__}")


def _reason(error: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix ("[hh:mm:ss] file.cc:123: ")."""
    text = str(error).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition("] ")
        if ".cc:" in rest.split(" ", 1)[0]:
            text = rest.split(": ", 1)[1] if ": " in rest else rest
    return text.split("\n", 1)[0]
