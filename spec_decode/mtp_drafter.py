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
draft passes of a step are one call (spec_decode/draft_passes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.spec_decode.draft_passes import DraftPasses
from hybrid_engine.state_cache import HybridCacheManager

if TYPE_CHECKING:
    from hybrid_engine.step_inputs import StepInputBuilder
    from hybrid_engine.step_update import SegmentResult


@dataclass
class CatchUp:
    request_id: str
    start: int                 # position of the first MTP input
    next_tokens: list[int]     # token i+1 for each position i in start..start+n-1
    hidden: torch.Tensor       # [n, H] the target's final-normed hidden states at those positions
    draft: bool                # propose drafts from the last position


class MTPDrafter:
    def __init__(self, model: HybridForCausalLM, cache: HybridCacheManager, num_speculative_tokens: int,
                 builder: StepInputBuilder, compiled=None):
        if model.mtp is None:
            raise ValueError("speculative decoding with method 'mtp' needs a checkpoint with mtp.* "
                             "weights; this one has none")
        self.model = model
        self.cache = cache
        self.k = num_speculative_tokens
        self.builder = builder          # packs the passes into the step inputs' buffers
        self.compiled = compiled        # hybrid_engine.compiled_steps.CompiledSteps or None
        self.passes = DraftPasses(num_speculative_tokens, builder.block_size, 1 in builder.keyless_query_lens)
        self.device = model.norm.weight.device

    @torch.inference_mode()
    def run(self, catchups: list[CatchUp]) -> dict[str, list[int]]:
        """Advances the MTP KV; returns request id -> k drafts for each catch-up with draft=True.
        The drafts go into the step's output (hybrid_engine/step_update.py), which hands them
        to the request for its next verify; the drafter itself changes no request."""
        if not catchups:
            return {}
        segs = [(c.request_id, c.start, len(c.next_tokens)) for c in catchups]
        tokens = self._tensor([t for c in catchups for t in c.next_tokens])
        hidden = catchups[0].hidden if len(catchups) == 1 else torch.cat([c.hidden for c in catchups])
        drafting = [i for i, c in enumerate(catchups) if c.draft]
        if not drafting:
            self.model.mtp_forward(tokens, hidden, self._batch(segs, 0)[0], self.cache.pools)
            return {}
        # Block tables that also cover the k-1 draft positions after the catch-up.
        batch, tables = self._batch(segs, self.k - 1)
        ends = segs_end_rows(segs)
        rows, seqs = self._tensor([ends[i] for i in drafting] + drafting).split(len(drafting))
        n = segs[0][2]
        if self.compiled is None:
            drafts = self.passes(self.model, tokens, hidden, batch, self.cache.pools, tables, rows, seqs)
        elif n <= self.k + 1 and all(m == n for _, _, m in segs):
            # A decode-sized catch-up of segments of one length (attention needs no per-length
            # split): all of drafting in one graph.
            drafts = self.compiled.run_mtp(tokens, hidden, batch, self.cache.pools, tables, rows, seqs, self.passes)
        else:
            # A prompt's catch-up (its length changes every time) stays eager; the draft
            # passes after it are one graph.
            h, draft = self.passes.catch_up(self.model, tokens, hidden, batch, self.cache.pools, rows)
            drafts = self.compiled.run_draft_passes(draft, h, batch.positions[rows], tables[seqs], batch.kernels,
                                                    self.cache.pools, self.passes)
        return dict(zip([catchups[i].request_id for i in drafting], drafts.tolist()))

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _batch(self, segs: list[tuple[str, int, int]], lookahead: int) -> tuple[ForwardBatch, torch.Tensor]:
        """The catch-up pass's metadata, packed by the step-input builder into its own buffers,
        and block tables covering `lookahead` positions more."""
        return self.builder.build_mtp([(start, n, self.cache.get(rid).block_table) for rid, start, n in segs],
                                      lookahead)



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
    return CatchUp(req.request_id, start, next_tokens, rows, draft=seg.samples and not finishing)


def segs_end_rows(segs: list[tuple[str, int, int]]) -> list[int]:
    rows, total = [], 0
    for _, _, n in segs:
        total += n
        rows.append(total - 1)
    return rows
