"""What generate() returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" | "length" | "abort" | None while running
    logprobs: list[dict[int, float]] | None
    finished: bool
    stop_reason: str | int | None = None
    metrics: dict = field(default_factory=dict)   # time_to_first_token, time_per_output_token, ...
    # Streaming deltas: what this step added.
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
