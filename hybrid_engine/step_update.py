"""The update half of a step: what sampling, verification and drafting produced, applied to the
requests and the cache in one place (nano-vllm's `postprocess`, vLLM's `update_from_output`).

For each segment of the step, in packing order:
1. commit: the cache's committed length moves to what this step made valid (a prefill chunk, a
   decode's token, or a verify's last token plus its accepted drafts), and after a verify the
   committed GDN slot moves with it, in one cache verb; a prefill chunk's prompt logprobs
   (SamplingParams.prompt_logprobs) are added to the request's;
2. append the emitted tokens one at a time, applying every stop rule after each: a stop
   inside a verify's accepted drafts drops the tokens after it;
3. a finished request leaves the scheduler and its memory is freed; a running one takes the
   drafts the drafter proposed for its next verify (the only place they are set);
4. one RequestOutput, with its streaming delta, for each request that emitted tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hybrid_engine.spec_decode.stats import SpecStats
from hybrid_engine.state_cache import HybridCacheManager

from .outputs import CompletionOutput, Prefix, RequestOutput
from .prefix_caching import PrefixCaching
from .request import Request
from .scheduler import Scheduler
from .step_inputs import Segment


@dataclass
class SegmentResult:
    """What sampling / verification produced for one segment of the step."""

    segment: Segment
    # Emitted tokens: none for a prefill chunk short of the prompt's end, one for a prefill's
    # end or a decode, 1..k+1 for a verify (its accepted drafts plus the target's token).
    token_ids: list[int]
    logprobs: list          # one per emitted token; None entries where not asked for


@dataclass
class StepOutput:
    results: list[SegmentResult]        # one per segment of the step, in packing order
    drafts: dict[str, list[int]]        # request id -> the drafts its next step verifies
    hidden: torch.Tensor                # the target's final-normed hidden rows (prefix checkpoints keep some)
    # request id -> the prompt logprobs its prefill chunk scored (prompt_logprobs.py), in order
    prompt_logprobs: dict[str, list[dict[int, float]]]


class StepUpdater:
    def __init__(self, scheduler: Scheduler, cache: HybridCacheManager, max_model_len: int,
                 spec_stats: SpecStats | None, prefix: PrefixCaching | None = None):
        self.scheduler = scheduler
        self.cache = cache
        self.max_model_len = max_model_len
        self.spec_stats = spec_stats     # the engine's totals, next to each request's own
        self.prefix = prefix

    def update(self, step: StepOutput) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()          # when this step's tokens arrived, every one of them
        if self.prefix is not None:     # before any commit: a verify's write slots still hold its states
            self.prefix.take_checkpoints(step.results, step.hidden)
        for result in step.results:
            req = result.segment.request
            self._commit(result)
            scored = step.prompt_logprobs.get(req.request_id)
            if scored:
                req.prompt_logprobs.extend(scored)
            if self.prefix is not None:
                self.prefix.cache_blocks(req)
            new = []
            for tok, lp in zip(result.token_ids, result.logprobs):
                new.append(tok)
                if self._append_token(req, tok, lp, now):
                    break
            if not req.is_finished:
                req.draft_token_ids = step.drafts.get(req.request_id, [])
            if result.token_ids:
                outputs.append(request_output(req, new, take_text_delta(req)))
        return outputs

    def _commit(self, result: SegmentResult) -> None:
        """What the step made valid: a prefill chunk, a decode's token, or after a verify the
        last token plus the accepted drafts (KV length C + accepted + 1), with the committed
        GDN state now the one saved after the last accepted position, chosen by slot (no
        copy, no recompute)."""
        seg, req = result.segment, result.segment.request
        if not seg.is_decode:
            req.num_computed_tokens += seg.num_tokens
            self.cache.commit(req.request_id, req.num_computed_tokens)
            return
        accepted = len(result.token_ids) - 1            # 0 for a plain decode
        req.num_computed_tokens = seg.start + accepted + 1
        self.cache.commit(req.request_id, req.num_computed_tokens, accepted)
        if seg.num_tokens > 1:                          # a verify
            req.spec_stats.record(seg.num_tokens - 1, accepted)
            self.spec_stats.record(seg.num_tokens - 1, accepted)

    def _append_token(self, req: Request, tok: int, logprobs, now: float) -> bool:
        """Appends one token and applies every stop rule (vLLM's): none fires before min_tokens;
        an EOS or stop token ends the request and, unless include_stop_str_in_output, its text
        stays out of `text`; a stop string cuts the text where it starts (or after it, with
        include_stop_str_in_output); a structured output whose grammar has ended stops; then
        max_tokens and max_model_len. True when finished."""
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.output_token_ids.append(tok)
        if logprobs is not None:
            req.output_logprobs.append(logprobs)
        if req.grammar is not None:
            req.grammar.accept(tok)
        p = req.params
        may_stop = len(req.output_token_ids) >= p.min_tokens
        is_eos = may_stop and not p.ignore_eos and tok in req.eos_token_ids
        is_stop_token = may_stop and not is_eos and tok in p.stop_token_ids
        detok = req.detokenizer
        new_text = 0
        if detok is not None and (p.include_stop_str_in_output or not (is_eos or is_stop_token)):
            new_text = len(detok.update(req.output_token_ids))
            req.text = detok.text
        if is_eos or is_stop_token:
            req.finish_reason, req.stop_reason = "stop", tok if is_stop_token else None
        elif p.stop and detok is not None and may_stop:
            _cut_at_stop_string(req, new_text)
        if req.finish_reason is None and req.grammar is not None and req.grammar.terminated:
            req.finish_reason = "stop"      # the structure is complete (its end accepted under ignore_eos)
        if req.finish_reason is None and req.finishes_by_length(self.max_model_len):
            req.finish_reason = "length"
        if req.finish_reason is None:
            return False
        req.metrics.finished_time = now
        self.scheduler.finish(req)
        return True


def _cut_at_stop_string(req: Request, new_text: int) -> None:
    """Finds the first stop string that ends in the last `new_text` characters, at a cost that
    does not grow with the number of stop strings (hybrid_engine/stop_strings.py)."""
    stops = req.params.stop_strings
    search_from = max(0, len(req.text) - new_text - stops.longest + 1)
    hit = stops.first_match(req.text, search_from)
    if hit is None:
        return
    i, s = hit
    req.text = req.text[:i + len(s) if req.params.include_stop_str_in_output else i]
    req.finish_reason, req.stop_reason = "stop", s


def take_text_delta(req: Request) -> str:
    """Text not yet streamed. While a request runs, the longest end of its text that could be
    the start of a stop string is held back (at most len(stop) - 1 characters): a cut at that
    stop string would otherwise take back text already streamed. So the deltas of a request
    always join to its final text."""
    end = len(req.text)
    if req.finish_reason is None and req.params.stop:
        end -= req.params.stop_strings.held_back(req.text)
    if end <= req.streamed_len:
        return ""
    delta = req.text[req.streamed_len:end]
    req.streamed_len = end
    return delta


def request_output(req: Request, new_ids: list[int], new_text: str) -> RequestOutput:
    m = req.metrics
    logprobs = req.output_logprobs if req.params.logprobs is not None else None
    completion = CompletionOutput(
        index=req.index, text=req.text, token_ids=Prefix(req.output_token_ids, len(req.output_token_ids)),
        finish_reason=req.finish_reason,
        logprobs=None if logprobs is None else Prefix(logprobs, len(logprobs)),
        stop_reason=req.stop_reason, new_token_ids=new_ids, new_text=new_text,
        metrics={"time_to_first_token": m.time_to_first_token,
                 "time_per_output_token": m.time_per_output_token(len(req.output_token_ids)),
                 "num_preemptions": req.num_preemptions,
                 "spec_decode": req.spec_stats.as_dict() if req.spec_stats is not None else None})
    return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                         outputs=[completion], finished=req.finish_reason is not None,
                         num_cached_tokens=req.num_cached_tokens, prompt_logprobs=req.prompt_logprobs)
