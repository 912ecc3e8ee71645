"""One engine step, in one direction: schedule -> build -> forward -> sample / verify -> draft
-> update.

The scheduler picks the batch and reserves its memory, the builder packs it, the runner runs
the model, the sampler and verifier turn logits into emitted tokens (and the prompt rows of
requests that ask for prompt_logprobs are scored: prompt_logprobs.py), the MTP drafter proposes
the next drafts, and the updater (step_update.py) applies all of it (prefix checkpoints,
tokens, stops, commits, frees) in one place. Nothing here knows about
callers, request ids or failures: LLMEngine (engine.py) wires these parts and handles those.
"""

from __future__ import annotations

import time

import torch

from hybrid_engine.spec_decode.mtp_drafter import MTPDrafter, catch_up
from hybrid_engine.state_cache import HybridCacheManager

from .model_runner import ModelRunner
from .outputs import RequestOutput
from .prompt_logprobs import score_prompt_rows
from .sampler import Sampler
from .sampling_step import sample_segments
from .scheduler import ScheduledBatch
from .step_inputs import StepInputBuilder
from .step_update import SegmentResult, StepOutput, StepUpdater


class EngineStep:
    def __init__(self, cache: HybridCacheManager, builder: StepInputBuilder, runner: ModelRunner,
                 drafter: MTPDrafter | None, updater: StepUpdater, max_model_len: int, prefix_caching: bool):
        self.cache = cache
        self.builder = builder
        self.runner = runner
        self.sampler = Sampler()
        self.drafter = drafter
        # With prefix caching, the MTP KV of every committed position is kept: later hits share it.
        self.mtp_keeps_all = prefix_caching
        self.updater = updater
        self.max_model_len = max_model_len

    def run(self, sched: ScheduledBatch) -> list[RequestOutput]:
        """The step of a scheduled, non-empty batch -> an output per sequence that advanced."""
        now = time.monotonic() if sched.prefills else None      # a request is first scheduled to prefill
        for req, _ in sched.prefills:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        inputs = self.builder.build(sched, self.cache)
        hidden, logits = self.runner.forward(inputs)
        results = sample_segments(inputs, logits, self.sampler)
        scored = (score_prompt_rows(inputs.prompt_rows, hidden, self.runner.logits, self.runner.vocab_size)
                  if inputs.prompt_rows else {})
        return self.updater.update(StepOutput(results, self._draft(results, hidden), hidden, scored))

    def _draft(self, results: list[SegmentResult], hidden: torch.Tensor) -> dict[str, list[int]]:
        """The MTP drafter catches up over what each segment commits and proposes the drafts of
        each request that sampled (none without speculation)."""
        if self.drafter is None:
            return {}
        keep_all = self.mtp_keeps_all
        return self.drafter.run([c for r in results
                                 if (c := catch_up(r, hidden, self.cache, self.max_model_len, keep_all)) is not None])
