"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}} with the status.

400: a bad request (malformed JSON, a wrong type, an unknown field, a value the engine's
validation refuses: its message names the field); 401: a missing or wrong API key; 404: an
unknown model or path; 408: the request ran past its X-Request-Timeout; 500: an engine fault;
503: the model is still loading, the server is shutting down, its engine has stopped, or it
holds too many requests (then with a Retry-After header).
"""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse
from pydantic import ValidationError

from .protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 408: "RequestTimeoutError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.headers)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "Error"),
                                         param=param, code=status)).model_dump()


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def bad_request_from_validation(e: ValidationError) -> APIError:
    """One line per problem, each naming the field by its path (messages[0].role: ...)."""
    by_field: dict[str, list[dict]] = {}
    for err in e.errors(include_url=False):
        if err["type"] == "json_invalid":
            return APIError(400, f"malformed JSON body: {err.get('ctx', {}).get('error', err['msg'])}")
        by_field.setdefault(_path(err["loc"]), []).append(err)
    lines = []
    for field, errs in by_field.items():
        err = errs[0]
        if err["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown field (not part of this endpoint's request)")
        elif err["type"] == "missing":
            lines.append(f"{field}: field required")
        elif len(errs) > 1:   # every member of a union refused it
            lines.append(f"{field}: wrong type (got {err.get('input')!r:.80})")
        else:
            lines.append(f"{field}: {err['msg']} (got {err.get('input')!r:.80})")
    return APIError(400, "; ".join(lines) or "invalid request body", next(iter(by_field), None))


def _path(loc: tuple) -> str:
    out = ""
    for part in loc:
        # pydantic adds the matching member of a union (str, list[int], ...) to the path
        if isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list")):
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "body"


_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_error(body: bytes) -> APIError | None:
    """pydantic's JSON parser calls a lone UTF-16 surrogate escape ("\\ud800") malformed JSON. It
    is valid JSON, but not text (it has no UTF-8 form, no tokenizer takes it): name the field."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    stack = [(value, ())]
    while stack:   # a stack, not recursion: any depth json.loads took is fine here
        item, loc = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            field = _path(loc)
            return APIError(400, f"{field}: contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                                 "escape), which is not a character; send valid Unicode text", field)
        if isinstance(item, dict):
            for key, v in reversed(item.items()):
                stack.append((key, loc) if _SURROGATE.search(key) else (v, loc + (key,)))
        elif isinstance(item, list):
            stack.extend((v, loc + (i,)) for i, v in reversed(list(enumerate(item))))
    return None
