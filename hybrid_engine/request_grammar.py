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
        """Advances past one emitted token. Every emitted token was sampled under this grammar's
        mask, so a rejection is a bug, not a model's choice."""
        if self.in_reasoning:
            self.in_reasoning = token != self.think_end
            return
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"the grammar rejected token {token}, which was sampled under its mask")

    def fill_masks(self, drafts: list[int], bitmask: torch.Tensor, first: int, n: int) -> None:
        """Rows first..first+n-1 of `bitmask` [rows, ceil(V/32)] int32: the mask at each of the n
        positions of this request's segment, position j the one after drafts d1..dj. At the
        first draft the grammar rejects the walk stops: that position's mask excludes the
        draft, so the verify cannot accept it, and the rows after it are never used (all
        allowed: they only keep every segment of the step k+1 rows long)."""
        in_reasoning, accepted, rejected = self.in_reasoning, 0, False
        for j in range(n):
            if rejected or in_reasoning or self.matcher.is_terminated():
                bitmask[first + j].fill_(ALL_ALLOWED)
            else:
                self.matcher.fill_next_token_bitmask(bitmask, first + j)
            if j == n - 1 or rejected:
                continue
            tok = drafts[j]
            if in_reasoning:
                in_reasoning = tok != self.think_end
            elif self.matcher.is_terminated() or not self.matcher.accept_token(tok):
                rejected = True
            else:
                accepted += 1
        if accepted:
            self.matcher.rollback(accepted)


def mask_logits(logits: torch.Tensor, spans: list[tuple[object, int, int]]) -> torch.Tensor:
    """Applies the grammars of the (segment, first row, rows) spans whose requests have one to
    their rows of `logits`: disallowed tokens -> -inf. Float32 (a copy where `logits` is not),
    the sampler's and the greedy argmax's dtype. Returns `logits` itself when no span has one.
    The mask is applied by kernels/sampling (the native kernel skips the all-ones rows of the
    unconstrained requests at a compare per 32 tokens)."""
    constrained = [span for span in spans if span[0].request.grammar is not None]
    if not constrained:
        return logits
    if logits.dtype != torch.float32:
        logits = logits.float()
    bitmask = torch.full((logits.shape[0], (logits.shape[1] + 31) // 32), ALL_ALLOWED, dtype=torch.int32)
    for seg, first, n in constrained:
        seg.request.grammar.fill_masks(seg.request.draft_token_ids, bitmask, first, n)
    with torch.inference_mode():        # the runner's logits are inference tensors: in place only in here
        if logits.is_cpu:
            apply_token_bitmask(logits, bitmask)
        else:
            apply_token_bitmask_torch(logits, bitmask.to(logits.device, non_blocking=True))
    return logits
