"""One engine step, in one direction: schedule -> build -> forward -> sample / verify -> draft
-> update.

The scheduler picks the batch and reserves its memory, the builder packs it, the runner runs
the model, the sampler and verifier turn logits into emitted tokens, the MTP drafter proposes
the next drafts, the prefix cache keeps its checkpoints, and the updater (step_update.py)
applies all of it (tokens, stops, commits, frees) in one place. Nothing here knows about
callers, request ids or failures: LLMEngine (engine.py) wires these parts and handles those.
"""

from __future__ import annotations

import time

import torch

from hybrid_engine.spec_decode.mtp_drafter import MTPDrafter, catch_up
from hybrid_engine.state_cache import HybridCacheManager

from .model_runner import ModelRunner
from .outputs import RequestOutput
from .prefix_caching import PrefixCaching
from .sampler import Sampler
from .sampling_step import sample_segments
from .scheduler import ScheduledBatch
from .step_inputs import StepInputBuilder
from .step_update import SegmentResult, StepOutput, StepUpdater


class EngineStep:
    def __init__(self, cache: HybridCacheManager, builder: StepInputBuilder, runner: ModelRunner,
                 drafter: MTPDrafter | None, prefix: PrefixCaching | None, updater: StepUpdater,
                 max_model_len: int):
        self.cache = cache
        self.builder = builder
        self.runner = runner
        self.sampler = Sampler()
        self.drafter = drafter
        self.prefix = prefix
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
        drafts = self._draft(results, hidden)
        if self.prefix is not None:
            self.prefix.take_checkpoints(results, hidden)
        return self.updater.update(StepOutput(results, drafts))

    def _draft(self, results: list[SegmentResult], hidden: torch.Tensor) -> dict[str, list[int]]:
        """The MTP drafter catches up over what each segment commits and proposes the drafts of
        each request that sampled (none without speculation)."""
        if self.drafter is None:
            return {}
        keep_all = self.prefix is not None      # later prefix hits share every committed position's MTP KV
        return self.drafter.run([c for r in results
                                 if (c := catch_up(r, hidden, self.cache, self.max_model_len, keep_all)) is not None])
