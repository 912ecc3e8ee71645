"""MTP drafting: keep the MTP layer's KV caught up with the target, then draft k tokens.

Convention (vLLM's): the MTP input at position i pairs the target's final-normed hidden
state h_i with the embedding of token i+1, runs at RoPE position i, writes the MTP layer's
KV at position i (through the request's own block table), and predicts token i+2.

After each step, for every request the target just advanced, the MTP layer runs over the
positions the target committed (a prefill chunk, or the accepted part of a verify), so its
KV always matches the committed tokens. For requests that sampled, the output at the last
committed position gives draft 1; drafts 2..k reuse the same layer one token at a time,
fed with the MTP's own output hidden state. Those later positions are overwritten by the
next catch-up, which keeps the MTP KV consistent after rejections.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.state_cache import HybridCacheManager

if TYPE_CHECKING:
    from hybrid_engine.step_inputs import StepInputBuilder


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
        ends = segs_end_rows(segs)
        h_last, draft = self._pass(tokens, hidden, segs, [ends[i] for i in drafting])
        if not drafting:
            return {}
        drafts = [draft]
        ids = [catchups[i].request_id for i in drafting]
        pos = [catchups[i].start + len(catchups[i].next_tokens) - 1 for i in drafting]
        for _ in range(self.k - 1):
            pos = [p + 1 for p in pos]
            h_last, draft = self._pass(draft, h_last, [(rid, p, 1) for rid, p in zip(ids, pos)], None)
            drafts.append(draft)
        stacked = torch.stack(drafts, dim=1).tolist()
        return dict(zip(ids, stacked))

    def _pass(self, tokens: torch.Tensor, hidden: torch.Tensor, segs: list[tuple[str, int, int]],
              rows: list[int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One MTP pass over segs -> (its output hidden at `rows`, None: at every row; the
        greedy token from each of those, None when rows is empty)."""
        batch = self._batch(segs)
        n = segs[0][2]
        # Compiled passes are decode-sized (a prompt's catch-up is not) with segments of one
        # length (attention then needs no per-length split), and draft from some row.
        if (self.compiled is not None and rows != [] and n <= self.k + 1
                and all(m == n for _, _, m in segs)):
            index = None if rows is None else self._tensor(rows)
            return self.compiled.run_mtp(tokens, hidden, batch, self.cache, index)
        h = self.model.mtp_forward(tokens, hidden, batch, self.cache)
        if rows is not None:
            if not rows:
                return h[:0], None
            h = h[rows[0]:rows[0] + 1] if len(rows) == 1 else h.index_select(0, self._tensor(rows))
        return h, self.model.compute_logits(h).max(dim=-1).indices     # max: cheaper than argmax on CPU

    def _tensor(self, values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _batch(self, segs: list[tuple[str, int, int]]) -> ForwardBatch:
        """The pass's metadata, packed by the step-input builder into its own buffers."""
        return self.builder.build_mtp([(start, n, self.cache.get(rid).block_table) for rid, start, n in segs])


def segs_end_rows(segs: list[tuple[str, int, int]]) -> list[int]:
    rows, total = [], 0
    for _, _, n in segs:
        total += n
        rows.append(total - 1)
    return rows
