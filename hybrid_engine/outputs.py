"""What generate() returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Prefix(NamedTuple):
    """The first `length` items of a list that is only ever appended to (a request's outputs)."""

    items: list
    length: int


class _Cumulative:
    """A list field that may also be set to a Prefix, copied into a list on first read: the
    engine hands out every step's output for O(new tokens), not O(tokens so far), and an
    output keeps the prefix it was made with however the request grows afterwards."""

    def __set_name__(self, owner, name):
        self.attr = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:   # no class-level default: the dataclass field stays required
            raise AttributeError(self.attr)
        value = obj.__dict__[self.attr]
        if isinstance(value, Prefix):
            value = obj.__dict__[self.attr] = value.items[:value.length]
        return value

    def __set__(self, obj, value):
        obj.__dict__[self.attr] = value


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int] = _Cumulative()
    finish_reason: str | None          # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = _Cumulative()
    finished: bool
    stop_reason: str | int | None = None
    metrics: dict = field(default_factory=dict)   # time_to_first_token, time_per_output_token, ...
    # Streaming deltas: what this step added.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache (vLLM's name)
