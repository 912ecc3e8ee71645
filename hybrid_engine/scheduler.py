"""One scheduler for both cache kinds: continuous batching with chunked prefill and preemption.

Every step re-chooses the batch under `max_num_seqs` and `max_num_batched_tokens`:
1. running requests first, in arrival order: decodes take one token each (so new prefills
   never starve them), unfinished prefills take the next chunk of what budget is left;
   when a request cannot grow its KV, the newest running request is preempted (freed,
   re-prefilled later with its generated tokens kept) until it can;
2. then waiting requests are admitted first come, first served while the cache manager says
   both their KV blocks and their GDN state slot(s) fit; admission stops at the first that
   does not fit, so a large old request is never overtaken, and at a request preempted in
   this same call (readmitting it at once would free and retake its memory for nothing).
   A request whose structured-output grammar is still compiling is passed over until it is
   ready; the requests behind it go ahead.

With prefix caching (hybrid_engine/prefix_caching.py) an admitted request starts from the
longest cached prefix, each prefill chunk gets the GDN checkpoints wanted inside it (taken by
its forward, `ScheduledBatch.captures`), and a request whose prefix a running prefill is
about to checkpoint waits for it (in order, as any other request that does not fit yet).

The n samples of one prompt (hybrid_engine/request_group.py): sample 0 prefills all but the
last prompt token; at the start of the next schedule its cache is forked to each sibling
that fits now (a running slot, and memory for its next step), and a sibling that does not
waits at the front of the queue and prefills on its own. When the prefix cache already holds
all that sample 0 would prefill, nothing is forked: every sample starts from the hit.

A running request's KV reservation only grows: blocks past its committed length (rejected
drafts, the drafter's lookahead) stay with it for the next step (state_cache/hybrid_cache.py).
The outcome of a step (tokens, stops, commits, frees) is applied by hybrid_engine/step_update.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from hybrid_engine.state_cache import HybridCacheManager

from .prefix_caching import PrefixCaching
from .request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    prefills: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens this step)
    decodes: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # prefix caching: request id -> (position, checkpoint entry) the GDN states of its prefill
    # chunk are captured at, ascending
    captures: dict[str, list[tuple[int, int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.prefills) + len(self.decodes)


class Scheduler:
    def __init__(self, cache: HybridCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 num_speculative_tokens: int = 0, prefix: PrefixCaching | None = None):
        self.cache = cache
        self.prefix = prefix
        # With k drafts a request holds k draft state slots, and a step that samples reserves
        # KV for k-1 positions past its tokens, where the MTP drafts after the step.
        self.num_draft_slots = num_speculative_tokens
        self.lookahead = max(num_speculative_tokens - 1, 0)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self._fork_shared_prefixes()
        for req in list(self.running):
            if req.status != RequestStatus.RUNNING:      # preempted earlier in this loop
                continue
            need = req.num_uncomputed_tokens
            # With speculation a decode verifies its drafts; the last token of a chunked or
            # re-run prefill has none yet, so it stays a (one-token) prefill segment.
            is_decode = need == 1 and (self.num_draft_slots == 0 or bool(req.draft_token_ids))
            n = (1 + len(req.draft_token_ids) if is_decode
                 else min(_prefill_need(req, req.num_computed_tokens), budget))
            if n == 0 or budget < n:
                continue
            total = self._tokens_to_hold(req, req.num_computed_tokens, n)
            # It may hold that many already: blocks past its committed length stay with it.
            if total > self.cache.get(req.request_id).num_tokens and not self._grow(req, total, batch):
                continue
            if is_decode:
                batch.decodes.append(req)
            else:
                batch.prefills.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            at = self._first_ready()
            if at is None:
                break
            req = self.waiting[at]
            if req in batch.preempted:
                break
            hit = None
            if self.prefix is not None:
                hit = self.prefix.match(req)
                if self.prefix.should_wait(req, hit, self.running):
                    break
                if req.forks and hit is not None and _prefill_need(req, hit.num_tokens) == 0:
                    self._release_forks(req)
            start = hit.num_tokens if hit is not None else 0
            n = min(_prefill_need(req, start), budget)
            total = self._tokens_to_hold(req, start, n)
            if self.cache.allocate(req.request_id, total, self.num_draft_slots, hit) is None:
                break
            req.num_computed_tokens = start
            if self.prefix is not None:
                self.prefix.admitted(req, hit)
            del self.waiting[at]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.prefills.append((req, n))
            budget -= n
        if self.prefix is not None and batch.prefills:
            # After every admission: an entry is published when reserved, and no request may
            # match it before this step's forward has written it.
            batch.captures = self.prefix.plan_captures(batch.prefills, self._queued())
        return batch

    def _first_ready(self) -> int | None:
        """The index of the first waiting request that can run: one whose grammar still compiles
        waits without holding up those behind it (hybrid_engine/grammar_compiler.py)."""
        for i, req in enumerate(self.waiting):
            if req.grammar is None or req.grammar.ready:
                return i
        return None

    def waiting_for_grammars(self) -> list[Request]:
        """The waiting requests whose grammars are still compiling."""
        return [req for req in self.waiting if req.grammar is not None and not req.grammar.ready]

    def _fork_shared_prefixes(self) -> None:
        """Each running request whose siblings wait for its prompt prefix, now computed, gives
        each of them a copy of its cache (module docstring)."""
        for parent in [r for r in self.running if r.forks and r.num_uncomputed_tokens == 1]:
            siblings, parent.forks = parent.forks, []
            total = self._tokens_to_hold(parent, parent.num_computed_tokens, 1)
            left = []
            for sibling in siblings:
                if (len(self.running) < self.max_num_seqs
                        and self.cache.fork(parent.request_id, sibling.request_id, self.num_draft_slots,
                                            total) is not None):
                    sibling.num_computed_tokens = parent.num_computed_tokens
                    sibling.num_cached_tokens = parent.num_cached_tokens     # of the prompt it shares
                    sibling.status = RequestStatus.RUNNING
                    self.running.append(sibling)
                else:
                    left.append(sibling)
            self.waiting.extendleft(reversed(left))

    def _release_forks(self, req: Request) -> None:
        """The cache holds all of the prompt prefix `req` would prefill for its waiting siblings:
        each sample starts from that hit itself, as any request does, queued right behind it
        (a fork would copy what the cache shares, and `req` would have nothing to compute)."""
        siblings, req.forks = req.forks, []
        for i, sibling in enumerate(siblings, start=1):
            self.waiting.insert(i, sibling)

    def _tokens_to_hold(self, req: Request, start: int, n: int) -> int:
        samples = start + n >= req.num_tokens
        return start + n + (self.lookahead if samples else 0)

    def _queued(self) -> list[Request]:
        return [*self.running, *self.waiting]

    def _grow(self, req: Request, new_num_tokens: int, batch: ScheduledBatch) -> bool:
        """Grows `req` to new_num_tokens, preempting the newest running requests until it fits;
        False if `req` itself went."""
        while not self.cache.grow(req.request_id, new_num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def void(self, batch: ScheduledBatch) -> None:
        """Undoes what scheduling `batch` reserved beside its requests, when its step failed:
        the checkpoint entries its prefills were to write are published already (so that no
        request of the schedule could match them); perhaps unwritten, they must not stay."""
        if self.prefix is not None and batch.captures:
            self.prefix.void_captures(batch.captures)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request from the queues and free all its memory."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.request_id in self.cache:
            self._free(req)
        req.status = RequestStatus.FINISHED

    def _free(self, req: Request) -> None:
        """Frees the request's memory; with prefix caching its committed blocks stay cached."""
        if self.prefix is not None:
            self.prefix.before_free(req)
        self.cache.free(req.request_id)


def _prefill_need(req: Request, start: int) -> int:
    """Tokens left to prefill from `start` (the computed or prefix-cached tokens); one fewer
    while siblings wait for its prompt prefix."""
    return req.num_tokens - start - (1 if req.forks else 0)
