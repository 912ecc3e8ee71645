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

import torch

from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.state_cache import HybridCacheManager


@dataclass
class CatchUp:
    request_id: str
    start: int                 # position of the first MTP input
    next_tokens: list[int]     # token i+1 for each position i in start..start+n-1
    hidden: torch.Tensor       # [n, H] the target's final-normed hidden states at those positions
    draft: bool                # propose drafts from the last position


class MTPDrafter:
    def __init__(self, model: HybridForCausalLM, cache: HybridCacheManager, num_speculative_tokens: int,
                 block_size: int):
        if model.mtp is None:
            raise ValueError("speculative decoding with method 'mtp' needs a checkpoint with mtp.* "
                             "weights; this one has none")
        self.model = model
        self.cache = cache
        self.k = num_speculative_tokens
        self.block_size = block_size

    @torch.inference_mode()
    def run(self, catchups: list[CatchUp]) -> dict[str, list[int]]:
        """Advances the MTP KV; returns k drafts for each catch-up with draft=True."""
        if not catchups:
            return {}
        segs = [(c.request_id, c.start, len(c.next_tokens)) for c in catchups]
        tokens = torch.tensor([t for c in catchups for t in c.next_tokens], dtype=torch.int64)
        hidden = torch.cat([c.hidden for c in catchups], dim=0)
        h = self._forward(tokens, hidden, segs)
        ends = torch.tensor(segs_end_rows(segs))
        drafting = [i for i, c in enumerate(catchups) if c.draft]
        if not drafting:
            return {}
        h_last = h[ends[drafting]]
        draft = self.model.compute_logits(h_last).argmax(dim=-1)
        drafts = [draft]
        ids = [catchups[i].request_id for i in drafting]
        pos = [catchups[i].start + len(catchups[i].next_tokens) - 1 for i in drafting]
        for _ in range(self.k - 1):
            pos = [p + 1 for p in pos]
            h_last = self._forward(draft, h_last, [(rid, p, 1) for rid, p in zip(ids, pos)])
            draft = self.model.compute_logits(h_last).argmax(dim=-1)
            drafts.append(draft)
        stacked = torch.stack(drafts, dim=1).tolist()
        return dict(zip(ids, stacked))

    def _forward(self, tokens: torch.Tensor, hidden: torch.Tensor, segs: list[tuple[str, int, int]]) -> torch.Tensor:
        batch = self._batch(segs)
        embeds = self.model.embed_tokens(tokens)
        rope = self.model.rope(batch.positions, embeds.dtype)
        return self.model.mtp(embeds, hidden.to(embeds.dtype), batch, self.cache, rope)

    def _batch(self, segs: list[tuple[str, int, int]]) -> ForwardBatch:
        """Metadata for the MTP layer (full attention only: the GDN fields stay empty)."""
        bs = self.block_size
        positions, slots, cu, seq_lens, tables = [], [], [0], [], []
        for rid, start, n in segs:
            table = self.cache.get(rid).block_table
            pos = torch.arange(start, start + n)
            t = torch.tensor(table, dtype=torch.int64)
            positions.append(pos)
            slots.append(t[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            tables.append(table)
        width = max(len(t) for t in tables)
        bt = torch.zeros(len(segs), width, dtype=torch.int64)
        for i, t in enumerate(tables):
            bt[i, :len(t)] = torch.tensor(t)
        empty = torch.zeros(0, dtype=torch.int64)
        return ForwardBatch(
            positions=torch.cat(positions), cu_seqlens=torch.tensor(cu), seq_lens=torch.tensor(seq_lens),
            slot_mapping=torch.cat(slots), block_tables=bt, state_slots=empty,
            has_initial_state=empty.bool(), state_write_slots=empty.view(0, 1), logits_indices=empty,
            num_prefills=len(segs), num_prefill_tokens=cu[-1])


def segs_end_rows(segs: list[tuple[str, int, int]]) -> list[int]:
    rows, total = [], 0
    for _, _, n in segs:
        total += n
        rows.append(total - 1)
    return rows
