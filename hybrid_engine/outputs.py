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
class CompletionOutput:
    """One sample of a request's prompt (vLLM's name); SamplingParams(n=...) gives n of them,
    indexed 0..n-1."""

    index: int
    text: str
    token_ids: list[int] = _Cumulative()
    finish_reason: str | None          # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None = _Cumulative()
    stop_reason: str | int | None = None
    # Streaming deltas: what this step added.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # This sample's time_to_first_token, time_per_output_token, num_preemptions, spec_decode
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """One request's output, as vLLM's: `outputs` holds its completions, in index order. A
    finished output holds all n. While it runs, a step's output holds the completions that
    advanced in that step, each with its delta (new_token_ids / new_text).

    text, token_ids, finish_reason, logprobs, stop_reason, new_token_ids, new_text and
    metrics are outputs[0]'s: with n = 1 the one completion's, and on a finished output
    completion 0's."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0      # prompt tokens served from the prefix cache (vLLM's name)
    # SamplingParams.prompt_logprobs (vLLM's): per prompt token {token: logprob} of the k most
    # likely plus the prompt's own, the first None; on every output, complete from the first
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def new_token_ids(self) -> list[int]:
        return self.outputs[0].new_token_ids

    @property
    def new_text(self) -> str:
        return self.outputs[0].new_text

    @property
    def metrics(self) -> dict:
        return self.outputs[0].metrics
