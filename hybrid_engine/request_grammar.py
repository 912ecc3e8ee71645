"""One constrained request's grammar state, and the masks it puts on a step's logits rows.

The matcher follows the request's output tokens: each token the step's update appends is
accepted once (`accept`). Its state is a function of the output tokens alone, so a request
preempted and recomputed keeps it as it is (the recompute re-runs the model, not the output).

Speculation (vLLM's scheme, exact): a verify's k+1 rows are masked by walking the matcher
through the drafts, one mask per position, then rolling it back (`fill_masks`). Position j's
mask is the one a plain decode would use after d1..dj, and a position is used only when
d1..dj were accepted: greedy constrained output with MTP is the output without it, and seeded
sampling too. The drafts are in effect cut at the first one the grammar rejects: that
position's mask excludes it, so the verify stops there (the segment keeps its k+1 rows, as
every verify of a step has the same length).

Reasoning: when the prompt leaves the model inside a `<think>` block (Qwen3.5's template with
thinking on), nothing is constrained up to and including the `</think>` token; the grammar
starts after it.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from hybrid_engine.kernels.sampling import apply_token_bitmask_torch
from hybrid_engine.kernels.sampling.cpu import apply_token_bitmask

# Position rows a mask leaves unconstrained are all ones: every token allowed.
ALL_ALLOWED = -1


class RequestGrammar:
    def __init__(self, compiled: Future, think_end: int | None = None):
        self.compiled = compiled
        self.think_end = think_end
        self.in_reasoning = think_end is not None
        self._matcher = None

    @property
    def ready(self) -> bool:
        """Whether the grammar compiled: the scheduler admits only ready requests."""
        return self.compiled.done() and self.compiled.exception() is None

    @property
    def failed(self) -> bool:
        """Whether compiling raised (the engine then aborts the request, which never ran)."""
        return self.compiled.done() and self.compiled.exception() is not None

    @property
    def matcher(self):
        if self._matcher is None:
            import xgrammar as xgr

            self._matcher = xgr.GrammarMatcher(self.compiled.result())    # rollback is unbounded
        return self._matcher

    @property
    def terminated(self) -> bool:
        """The grammar accepted its end (a stop token): nothing may follow."""
        return not self.in_reasoning and self.matcher.is_terminated()

    def accept(self, token: int) -> None:
        """Advances past one emitted token: a walk of one token, kept (not closed). Every emitted
        token was sampled under this grammar's mask, so a rejection is a bug, not a model's choice."""
        walk = GrammarWalk(self)
        if not walk.accept(token):
            raise RuntimeError(f"the grammar rejected token {token}, which was sampled under its mask")
        self.in_reasoning = walk.in_reasoning

    def fill_masks(self, drafts: list[int], bitmask: torch.Tensor, first: int, n: int) -> None:
        """Rows first..first+n-1 of `bitmask` [rows, ceil(V/32)] int32: the mask at each of the n
        positions of this request's segment, position j the one after drafts d1..dj. From the
        first draft the grammar rejects on, the rows are all ones: that draft's own position
        excludes it, so the verify cannot accept it, and the rows after it are never used
        (they only keep every segment of the step k+1 rows long)."""
        walk = GrammarWalk(self)
        for j in range(n):
            walk.fill(bitmask, first + j)
            if j < n - 1:
                walk.accept(drafts[j])
        walk.close()


class GrammarWalk:
    """A look ahead from a request's grammar state: tokens accepted one at a time, the first one
    the grammar rejects ending the walk, and all of it rolled back by close()."""

    def __init__(self, grammar: RequestGrammar):
        self.grammar = grammar
        self.in_reasoning = grammar.in_reasoning
        self.accepted = 0
        self.rejected = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The mask of the walk's next token into bitmask[row]: all ones where nothing
        constrains it (reasoning, a rejected walk, a grammar already ended)."""
        matcher = self.grammar.matcher if not (self.rejected or self.in_reasoning) else None
        if matcher is None or matcher.is_terminated():
            bitmask[row].fill_(ALL_ALLOWED)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> bool:
        if self.rejected:
            return False
        if self.in_reasoning:
            self.in_reasoning = token != self.grammar.think_end
            return True
        matcher = self.grammar.matcher
        if matcher.is_terminated() or not matcher.accept_token(token):
            self.rejected = True
            return False
        self.accepted += 1
        return True

    def close(self) -> None:
        if self.accepted:
            self.grammar.matcher.rollback(self.accepted)
            self.accepted = 0


class DraftMasks:
    """Grammar-aware MTP drafts: each draft pass's logits of the drafting requests masked by
    their grammars, walked through the tokens this step emits (not yet accepted: the update
    comes after drafting) and the drafts before it. Unmasked, the MTP head proposes what the
    unconstrained model would write, and the constrained target rejects most of it (default
    model, JSON schemas, k=2: acceptance 0.90 -> 0.23). `walks`: one per drafting request, in
    the drafts' row order, None where unconstrained."""

    def __init__(self, walks: list[GrammarWalk | None]):
        self.walks = walks

    @classmethod
    def of(cls, drafting: list[tuple[RequestGrammar | None, list[int]]]) -> "DraftMasks | None":
        """(grammar, tokens the step emits) per drafting request -> the masks, or None when no
        drafting request is constrained."""
        if all(g is None for g, _ in drafting):
            return None
        walks = []
        for grammar, emitted in drafting:
            walk = GrammarWalk(grammar) if grammar is not None else None
            for tok in emitted if walk is not None else ():
                walk.accept(tok)
            walks.append(walk)
        return cls(walks)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [D, V] of one draft position -> float32, disallowed tokens -inf."""
        def fill(bitmask: torch.Tensor) -> None:
            for row, walk in enumerate(self.walks):
                if walk is not None:
                    walk.fill(bitmask, row)
        return _masked(logits, fill)

    def advance(self, drafts: list[int]) -> None:
        for walk, tok in zip(self.walks, drafts):
            if walk is not None:
                walk.accept(tok)

    def close(self) -> None:
        for walk in self.walks:
            if walk is not None:
                walk.close()


def mask_logits(logits: torch.Tensor, spans: list[tuple[object, int, int]]) -> torch.Tensor:
    """Applies the grammars of the (segment, first row, rows) spans whose requests have one to
    their rows of `logits`: disallowed tokens -> -inf. Float32 (a copy where `logits` is not),
    the sampler's and the greedy argmax's dtype. Returns `logits` itself when no span has one.
    The mask is applied by kernels/sampling (the native kernel skips the all-ones rows of the
    unconstrained requests at a compare per 32 tokens)."""
    constrained = [span for span in spans if span[0].request.grammar is not None]
    if not constrained:
        return logits

    def fill(bitmask: torch.Tensor) -> None:
        for seg, first, n in constrained:
            seg.request.grammar.fill_masks(seg.request.draft_token_ids, bitmask, first, n)
    return _masked(logits, fill)


def _masked(logits: torch.Tensor, fill) -> torch.Tensor:
    """logits [N, V] as float32 (a copy where they are not) with the masks fill(bitmask) writes
    into an all-ones bitmask [N, ceil(V/32)] applied: disallowed tokens -inf."""
    logits = logits.float()
    bitmask = torch.full((logits.shape[0], (logits.shape[1] + 31) // 32), ALL_ALLOWED, dtype=torch.int32)
    fill(bitmask)
    with torch.inference_mode():        # the runner's logits are inference tensors: in place only in here
        if logits.is_cpu:
            apply_token_bitmask(logits, bitmask)
        else:
            apply_token_bitmask_torch(logits, bitmask.to(logits.device, non_blocking=True))
    return logits
