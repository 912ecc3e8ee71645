"""A request's life: waiting -> running -> finished, with preemption back to waiting."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .request_grammar import RequestGrammar
from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer
from hybrid_engine.spec_decode.stats import SpecStats

if TYPE_CHECKING:
    from .request_group import RequestGroup


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def time_per_output_token(self, num_output_tokens: int) -> float | None:
        if self.finished_time is None or self.first_token_time is None or num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: list[int]
    # Only ever appended to: each RequestOutput reads a prefix of these lazily (outputs.Prefix).
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # SamplingParams.prompt_logprobs: one entry per prompt token scored so far, the first None
    # (nothing predicts it); complete before the first output token. None when not asked, and
    # for samples 1..n-1 of a group: sample 0 scores the prompt they share.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV and GDN state are in the cache. Per request, never shared with others:
    # a request's GDN state is valid exactly when this is > 0 (has_initial_state).
    num_computed_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text: str = ""
    streamed_len: int = 0      # characters of text already handed out as streaming deltas
    detokenizer: IncrementalDetokenizer | None = None    # None: the model folder has no tokenizer
    num_preemptions: int = 0
    # Keys the randomness of every output position (hybrid_engine/sampler.py): params.seed, or
    # the one the engine picked for an unseeded request.
    sampling_seed: int = 0
    # Speculative decoding: drafts to verify next step (set only by hybrid_engine/step_update.py
    # from the drafter's output), and per-request counters.
    draft_token_ids: list[int] = field(default_factory=list)
    spec_stats: "SpecStats | None" = None
    # Prefix caching (hybrid_engine/prefix_caching.py): the chain hash of each full block of the
    # tokens, and how many prompt tokens the cache served.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    # SamplingParams.n (hybrid_engine/request_group.py): which of its prompt's samples this is,
    # the group of samples it belongs to (None when n = 1), and the siblings waiting for a copy
    # of its cache once it has computed all but its last prompt token (set by the engine,
    # emptied by the scheduler when it forks them; until then its prefill stops there).
    index: int = 0
    group: "RequestGroup | None" = None
    forks: list["Request"] = field(default_factory=list)
    # SamplingParams.structured_outputs: the request's grammar, compiling until `ready` (the
    # scheduler admits it then), then matching its output tokens (hybrid_engine/request_grammar.py).
    grammar: RequestGrammar | None = None

    def token_ids_in(self, start: int, end: int) -> list[int]:
        """(prompt + output tokens)[start:end], without building the whole list."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    def prompt_positions_to_score(self, start: int, end: int) -> range:
        """The positions in [start, end) whose logits give a prompt logprob still missing
        (position p predicts prompt token p + 1); empty when none is asked for."""
        if self.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs) - 1), min(end, len(self.prompt_token_ids) - 1))

    @property
    def max_prefix_hit(self) -> int:
        """The most leading tokens a prefix-cache hit may serve: all but the last (whose logits
        are needed), and none from a position still to be scored for prompt_logprobs (vLLM's
        rule, that such a request reads no hit, kept to what it still needs: after a preemption
        its scored part may be served)."""
        limit = self.num_tokens - 1
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids):
            limit = min(limit, len(self.prompt_logprobs) - 1)
        return limit

    @property
    def caller_request_id(self) -> str:
        """The id the caller knows: its group's for one of n samples, else its own."""
        return self.request_id if self.group is None else self.group.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def finishes_by_length(self, max_model_len: int, more: int = 0) -> bool:
        """The length rule, in one place: whether the request, with `more` tokens appended to
        what it has, has reached max_tokens outputs or max_model_len tokens."""
        return (len(self.output_token_ids) + more >= self.params.max_tokens
                or self.num_tokens + more >= max_model_len)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
