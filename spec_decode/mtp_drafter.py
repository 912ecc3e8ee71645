"""MTP drafting: keep the MTP layer's KV caught up with the target, then draft k tokens.

Convention (vLLM's): the MTP input at position i pairs the target's final-normed hidden
state h_i with the embedding of token i+1, runs at RoPE position i, writes the MTP layer's
KV at position i (through the request's own block table), and predicts token i+2.

After each step, for every request the target just advanced, the MTP layer runs over the
positions the target committed (a prefill chunk, or the accepted part of a verify), so its
KV always matches the committed tokens. For requests that sampled, the output at the last
committed position gives draft 1; drafts 2..k reuse the same layer one token at a time,
fed with the MTP's own output hidden state. Those later positions are overwritten by the
next catch-up, which keeps the MTP KV consistent after rejections. The catch-up and the
draft passes of a step are one call (spec_decode/draft_passes.py). A constrained request's
drafts are its grammar's: each pass's logits masked (hybrid_engine/request_grammar.py
`DraftMasks`), or the target rejects what it could never write.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hybrid_engine.request_grammar import DraftMasks, RequestGrammar
from hybrid_engine.state_cache import HybridCacheManager

if TYPE_CHECKING:
    from hybrid_engine.model_runner import ModelRunner
    from hybrid_engine.step_update import SegmentResult


@dataclass
class CatchUp:
    request_id: str
    start: int                 # position of the first MTP input
    next_tokens: list[int]     # token i+1 for each position i in start..start+n-1
    hidden: torch.Tensor       # [n, H] the target's final-normed hidden states at those positions
    draft: bool                # propose drafts from the last position
    # A constrained request's grammar and the tokens this step emits (its drafts follow them)
    grammar: RequestGrammar | None = None
    emitted: list[int] = field(default_factory=list)


class MTPDrafter:
    def __init__(self, runner: ModelRunner, cache: HybridCacheManager):
        self.runner = runner        # packs the passes into its drafting buffers and runs them
        self.cache = cache

    def run(self, catchups: list[CatchUp]) -> dict[str, list[int]]:
        """Advances the MTP KV; returns request id -> k drafts for each catch-up with draft=True.
        The drafts go into the step's output (hybrid_engine/step_update.py), which hands them
        to the request for its next verify; the drafter itself changes no request."""
        if not catchups:
            return {}
        segs = [(c.start, len(c.next_tokens), self.cache.get(c.request_id).block_table) for c in catchups]
        hidden = catchups[0].hidden if len(catchups) == 1 else torch.cat([c.hidden for c in catchups])
        drafting = [i for i, c in enumerate(catchups) if c.draft]
        masks = DraftMasks.of([(catchups[i].grammar, catchups[i].emitted) for i in drafting])
        drafts = self.runner.draft(segs, [t for c in catchups for t in c.next_tokens], hidden, drafting, masks)
        if drafts is None:
            return {}
        return dict(zip([catchups[i].request_id for i in drafting], drafts.tolist()))


def catch_up(result: SegmentResult, hidden: torch.Tensor, cache: HybridCacheManager, max_model_len: int,
             keep_all: bool) -> CatchUp | None:
    """The MTP inputs for the positions this step commits: h_i with token i+1, where the
    tokens past the known ones are this step's emitted tokens (not appended yet). None for a
    request this step finishes by length, unless keep_all (prefix caching: later hits share the
    MTP KV of every committed position): its drafts would be thrown away."""
    seg, req, emitted = result.segment, result.segment.request, result.token_ids
    finishing = bool(emitted) and req.finishes_by_length(max_model_len, len(emitted))
    if finishing and not keep_all:
        return None
    n = len(emitted) if seg.is_decode else seg.num_tokens
    start, rows = seg.start, hidden[seg.first_row:seg.first_row + n]
    hit_hidden = None if seg.is_decode or not keep_all else cache.prefix_store.take_hit_hidden(req.request_id)
    if hit_hidden is not None:
        # After a prefix hit at L: the MTP entry at L - 1 pairs the cached h_{L-1} with this
        # request's token L, which the cached block's entry may not (one MTP token, not a block).
        start, n, rows = start - 1, n + 1, torch.cat([hit_hidden[None].to(rows.dtype), rows])
    next_tokens = req.token_ids_in(start + 1, start + n + 1 - len(emitted)) + emitted
    return CatchUp(req.request_id, start, next_tokens, rows, draft=seg.samples and not finishing,
                   grammar=req.grammar, emitted=emitted)
