"""The request fields that constrain the output -> the engine's StructuredOutputsParams.

Both endpoints take OpenAI's `response_format` (json_schema, json_object, text), vLLM's
`structured_outputs` (extra_body: the engine's own fields) and vLLM's older `guided_json`,
`guided_regex`, `guided_choice` and `guided_grammar`; chat adds `tool_choice` "required" or a
named function, whose schema tool_choice.py builds. A request sets at most one: two are a 400
naming them. The one set is parsed here (xgrammar: milliseconds), so that a bad schema, regex
or grammar is a 400 naming the request's own field before anything is submitted.
"""

from __future__ import annotations

from hybrid_engine.structured_outputs import StructuredOutputsParams

from .errors import APIError
from .protocol import SamplingFields

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# vLLM's guided_decoding_backend names a backend; this server has one.
BACKENDS = (None, "auto", "xgrammar")


def structured_outputs(req: SamplingFields, tool_choice_schema: dict | None = None) -> StructuredOutputsParams | None:
    """The request's one constraint, checked; None when it sets none."""
    if req.guided_decoding_backend not in BACKENDS:
        raise APIError(400, f"guided_decoding_backend: this server's only backend is xgrammar, got "
                            f"{req.guided_decoding_backend!r}", "guided_decoding_backend")
    given = _given(req, tool_choice_schema)
    if len(given) > 1:
        fields = [field for field, _ in given]
        raise APIError(400, f"{' and '.join(fields)}: a request may constrain its output in one way only, "
                            f"this one sets {len(fields)}", fields[0])
    if not given:
        return None
    field, params = given[0]
    _check(field, params)
    return params


def _given(req: SamplingFields, tool_choice_schema: dict | None) -> list[tuple[str, StructuredOutputsParams]]:
    """(the field a problem is reported at, what it asks for), for each constraint the request sets."""
    out = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        out.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            field = "response_format.json_schema" + ("" if fmt.json_schema is None else ".schema")
            raise APIError(400, f"{field}: required with response_format type json_schema", field)
        out.append(("response_format.json_schema.schema", StructuredOutputsParams(json=fmt.json_schema.schema_)))
    if req.structured_outputs is not None:
        out.append(("structured_outputs", StructuredOutputsParams(**req.structured_outputs.model_dump(by_alias=True))))
    for name, kind in GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            out.append((name, StructuredOutputsParams(**{kind: value})))
    if tool_choice_schema is not None:
        out.append(("tool_choice", StructuredOutputsParams(json=tool_choice_schema)))
    return out


def _check(field: str, params: StructuredOutputsParams) -> None:
    """The engine's check (SamplingParams.validate runs it again at submit), its message put in
    terms of the request's field: the engine names its own (`structured_outputs.regex`)."""
    try:
        params.validate()
    except ValueError as e:
        message = str(e)
        if field == "structured_outputs":   # the request used the engine's names: its message names the field
            raise APIError(400, message, message.split(" ", 1)[0]) from None
        reason = message.removeprefix(f"structured_outputs.{params.kind()} is not valid: ")
        raise APIError(400, f"{field} is not valid: {reason}", field) from None
