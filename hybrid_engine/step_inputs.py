"""Packs a ScheduledBatch into the model's inputs, in buffers allocated once (seed 002).

Every tensor a forward reads lives in a persistent buffer sized at start-up for the largest
step; a step writes its values in place and hands the model views of the used prefix, so a
GPU step can later be a captured graph with fixed addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.models import ForwardBatch
from hybrid_engine.state_cache import HybridCacheManager

from .request import Request
from .scheduler import ScheduledBatch


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    batch: ForwardBatch
    sampled_requests: list[Request]   # one per logits row, in order


class StepInputBuilder:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, device: torch.device | str = "cpu"):
        self.block_size = block_size
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_num_tokens, **i64)
        self.positions = torch.zeros(max_num_tokens, **i64)
        self.slot_mapping = torch.zeros(max_num_tokens, **i64)
        self.cu_seqlens = torch.zeros(max_num_seqs + 1, **i64)
        self.seq_lens = torch.zeros(max_num_seqs, **i64)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **i64)
        self.state_slots = torch.zeros(max_num_seqs, **i64)
        self.has_initial_state = torch.zeros(max_num_seqs, dtype=torch.bool, device=device)
        self.state_write_slots = torch.zeros(max_num_seqs, 1, **i64)
        self.logits_indices = torch.zeros(max_num_seqs, **i64)

    def build(self, sched: ScheduledBatch, cache: HybridCacheManager) -> StepInputs:
        # Prefill segments first, then single-token decodes (the order ForwardBatch expects).
        segments = list(sched.prefills) + [(r, 1) for r in sched.decodes]
        ids, positions, slots, cu, seq_lens, state_slots, has_init, logits_rows = [], [], [], [0], [], [], [], []
        sampled: list[Request] = []
        max_blocks = 1
        bs = self.block_size
        tables = []
        for req, n in segments:
            start = req.num_computed_tokens
            rc = cache.get(req.request_id)
            ids.extend(req.all_token_ids[start:start + n])
            pos = torch.arange(start, start + n)
            table = torch.tensor(rc.block_table, dtype=torch.int64)
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            state_slots.append(rc.slot)
            has_init.append(start > 0)
            tables.append(rc.block_table)
            max_blocks = max(max_blocks, len(rc.block_table))
            if start + n == req.num_tokens:          # the segment reaches the end: sample from it
                logits_rows.append(cu[-1] - 1)
                sampled.append(req)
        t, n_seq = len(ids), len(segments)
        self.input_ids[:t].copy_(torch.tensor(ids, dtype=torch.int64))
        self.positions[:t].copy_(torch.cat(positions))
        self.slot_mapping[:t].copy_(torch.cat(slots))
        self.cu_seqlens[:n_seq + 1].copy_(torch.tensor(cu))
        self.seq_lens[:n_seq].copy_(torch.tensor(seq_lens))
        self.state_slots[:n_seq].copy_(torch.tensor(state_slots))
        self.has_initial_state[:n_seq].copy_(torch.tensor(has_init))
        bt = self.block_tables[:n_seq, :max_blocks]
        bt.zero_()
        for i, table in enumerate(tables):
            bt[i, :len(table)] = torch.tensor(table)
        n_dec = len(sched.decodes)
        self.state_write_slots[:n_dec, 0].copy_(self.state_slots[len(sched.prefills):n_seq])
        self.logits_indices[:len(logits_rows)].copy_(torch.tensor(logits_rows, dtype=torch.int64))
        batch = ForwardBatch(
            positions=self.positions[:t], cu_seqlens=self.cu_seqlens[:n_seq + 1],
            seq_lens=self.seq_lens[:n_seq], slot_mapping=self.slot_mapping[:t], block_tables=bt,
            state_slots=self.state_slots[:n_seq], has_initial_state=self.has_initial_state[:n_seq],
            state_write_slots=self.state_write_slots[:n_dec], logits_indices=self.logits_indices[:len(logits_rows)],
            num_prefills=len(sched.prefills), num_prefill_tokens=sum(n for _, n in sched.prefills),
        )
        return StepInputs(self.input_ids[:t], batch, sampled)
