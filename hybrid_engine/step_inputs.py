"""Packs a ScheduledBatch into the model's inputs, in buffers allocated once (seed 002).

Every tensor a forward reads lives in a persistent buffer sized at start-up for the largest
step; a step writes its values in place and hands the model views of the used prefix, so a
GPU step can later be a captured graph with fixed addresses.

Segments are packed prefills first, then decodes. A decode is one token, or with
speculation 1 + k tokens: [last token, d1..dk]; its GDN state after position j is written
to write slot j = [committed slot, draft slot 1..k][j], so the committed state is only
replaced by choosing a slot after verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.models import ForwardBatch
from hybrid_engine.state_cache import HybridCacheManager

from .request import Request
from .scheduler import ScheduledBatch


@dataclass
class Segment:
    request: Request
    start: int          # position of the segment's first token (= tokens already cached)
    num_tokens: int
    first_row: int      # row of its first token in the packed stream
    is_decode: bool
    samples: bool       # reaches the end of the known tokens, so logits are needed


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    batch: ForwardBatch
    segments: list[Segment]
    # (segment, first logits row, number of logits rows) for each segment that samples
    sample_spans: list[tuple[Segment, int, int]]


class StepInputBuilder:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, num_speculative_tokens: int = 0, device: torch.device | str = "cpu"):
        self.block_size = block_size
        self.k = num_speculative_tokens
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_num_tokens, **i64)
        self.positions = torch.zeros(max_num_tokens, **i64)
        self.slot_mapping = torch.zeros(max_num_tokens, **i64)
        self.cu_seqlens = torch.zeros(max_num_seqs + 1, **i64)
        self.seq_lens = torch.zeros(max_num_seqs, **i64)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **i64)
        self.state_slots = torch.zeros(max_num_seqs, **i64)
        self.has_initial_state = torch.zeros(max_num_seqs, dtype=torch.bool, device=device)
        self.state_write_slots = torch.zeros(max_num_seqs, 1 + self.k, **i64)
        self.logits_indices = torch.zeros(max_num_tokens, **i64)

    def build(self, sched: ScheduledBatch, cache: HybridCacheManager) -> StepInputs:
        segments: list[Segment] = []
        row = 0
        for req, n in sched.prefills:
            start = req.num_computed_tokens
            segments.append(Segment(req, start, n, row, False, start + n == req.num_tokens))
            row += n
        for req in sched.decodes:
            n = 1 + len(req.draft_token_ids)
            segments.append(Segment(req, req.num_computed_tokens, n, row, True, True))
            row += n
        return self._pack(segments, len(sched.prefills), cache)

    def _pack(self, segments: list[Segment], num_prefills: int, cache: HybridCacheManager) -> StepInputs:
        bs = self.block_size
        ids, positions, slots, cu, seq_lens, state_slots, has_init, tables = [], [], [], [0], [], [], [], []
        logits_rows, spans, write_rows = [], [], []
        for seg in segments:
            req, start, n = seg.request, seg.start, seg.num_tokens
            rc = cache.get(req.request_id)
            if seg.is_decode:
                ids.append(req.all_token_ids[start])
                ids.extend(req.draft_token_ids)
                write_rows.append([rc.slot] + rc.draft_slots[:n - 1])
            else:
                ids.extend(req.all_token_ids[start:start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(rc.block_table, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            state_slots.append(rc.slot)
            has_init.append(start > 0)     # per request: GDN state exists iff it cached tokens
            tables.append(rc.block_table)
            if seg.samples:
                # A prefill samples from its last token; a decode/verify from all of its tokens.
                first = seg.first_row if seg.is_decode else seg.first_row + n - 1
                spans.append((seg, len(logits_rows), n if seg.is_decode else 1))
                logits_rows.extend(range(first, seg.first_row + n))
        t, n_seq, n_dec = len(ids), len(segments), len(segments) - num_prefills
        self.input_ids[:t].copy_(torch.tensor(ids, dtype=torch.int64))
        self.positions[:t].copy_(torch.cat(positions))
        self.slot_mapping[:t].copy_(torch.cat(slots))
        self.cu_seqlens[:n_seq + 1].copy_(torch.tensor(cu))
        self.seq_lens[:n_seq].copy_(torch.tensor(seq_lens))
        self.state_slots[:n_seq].copy_(torch.tensor(state_slots))
        self.has_initial_state[:n_seq].copy_(torch.tensor(has_init))
        max_blocks = max(len(tb) for tb in tables)
        bt = self.block_tables[:n_seq, :max_blocks]
        bt.zero_()
        for i, tb in enumerate(tables):
            bt[i, :len(tb)] = torch.tensor(tb)
        decode_len = segments[-1].num_tokens if n_dec else 1
        if any(len(w) != decode_len for w in write_rows):
            raise RuntimeError("decode segments of one step must all have the same length")
        wr = self.state_write_slots[:n_dec, :decode_len]
        if n_dec:
            wr.copy_(torch.tensor(write_rows))
        self.logits_indices[:len(logits_rows)].copy_(torch.tensor(logits_rows, dtype=torch.int64))
        batch = ForwardBatch(
            positions=self.positions[:t], cu_seqlens=self.cu_seqlens[:n_seq + 1],
            seq_lens=self.seq_lens[:n_seq], slot_mapping=self.slot_mapping[:t], block_tables=bt,
            state_slots=self.state_slots[:n_seq], has_initial_state=self.has_initial_state[:n_seq],
            state_write_slots=wr, logits_indices=self.logits_indices[:len(logits_rows)],
            num_prefills=num_prefills, num_prefill_tokens=sum(s.num_tokens for s in segments[:num_prefills]),
            decode_len=decode_len,
        )
        return StepInputs(self.input_ids[:t], batch, segments, spans)
