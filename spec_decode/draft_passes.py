"""One step's MTP drafting as one function: the catch-up pass, then the k-1 one-token passes.

Draft pass j (1..k-1) feeds each drafting request's draft j with the MTP's own output hidden
state at position p + j, where p is the position of its last committed token (the catch-up
row it drafts from). Its metadata is the catch-up pass's, moved on: the same block tables,
positions p + j, KV slots block_table[pos // block_size] * block_size + pos % block_size
(state_cache.kv_slots), lengths p + j + 1. It is computed here in torch from the catch-up
batch's tensors (its block tables packed wider: StepInputBuilder.build_mtp's lookahead)
rather than packed on the host for every pass, so that the whole of
drafting is one call: one graph (one dynamo entry) when compiled, and no host packing between
the passes when eager. The eager and compiled forms run this same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.kernels import KernelBackend
from hybrid_engine.kernels.attention import AttentionLayout, paged_keys
from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.models.batch import LayerCaches


@dataclass(frozen=True)
class DraftPasses:
    num_drafts: int     # k
    block_size: int
    # One-token passes' attention reads no PagedKeys (the native CPU kernel serves them:
    # StepInputBuilder.keyless_query_lens), so none are made for them.
    keyless: bool

    def __call__(self, model: HybridForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor,
                 batch: ForwardBatch, caches: LayerCaches, tables: torch.Tensor, rows: torch.Tensor,
                 seqs: torch.Tensor) -> torch.Tensor:
        """The catch-up pass over `batch` (tokens [T] = token i+1, hidden [T, H] = the target's
        h_i), then the k-1 draft passes of the drafting requests: their catch-up rows `rows`
        [D] and sequences `seqs` [D] in `batch` -> the drafts [D, k]. tables: the batch's
        sequences' block tables covering the positions up to p + k - 1 of those that draft."""
        h, draft = self.catch_up(model, tokens, hidden, batch, caches, rows)
        return self.continued(model, draft, h, batch.positions.index_select(0, rows),
                              tables.index_select(0, seqs), batch.kernels, caches)

    def catch_up(self, model: HybridForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor,
                 batch: ForwardBatch, caches: LayerCaches, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up pass -> (its output hidden at `rows`, draft 1 from each of them)."""
        h = model.mtp_forward(tokens, hidden, batch, caches).index_select(0, rows)
        return h, _greedy(model, h)

    def continued(self, model: HybridForCausalLM, draft: torch.Tensor, h: torch.Tensor, last: torch.Tensor,
                  tables: torch.Tensor, kernels: KernelBackend, caches: LayerCaches) -> torch.Tensor:
        """Draft passes 2..k after the catch-up: draft 1 [D] and its hidden [D, H] at positions
        `last` [D] over the drafting requests' `tables` [D, W] -> the drafts [D, k]."""
        drafts = [draft]
        for j in range(1, self.num_drafts):
            h = model.mtp_forward(draft, h, self.pass_batch(last + j, tables, kernels), caches)
            draft = _greedy(model, h)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    def pass_batch(self, positions: torch.Tensor, tables: torch.Tensor, kernels: KernelBackend) -> ForwardBatch:
        """A one-token pass of each drafting request at `positions` [D], over `tables` [D, W]
        (what StepInputBuilder.build_mtp packs for segments (position, 1, table))."""
        bs = self.block_size
        d = positions.shape[0]
        slots = tables.gather(1, (positions // bs)[:, None])[:, 0] * bs + positions % bs
        seq_lens = positions + 1
        keys = None if self.keyless else paged_keys(tables, seq_lens, 1, bs)
        no_rows = positions[:0]          # the MTP layer is attention only: no GDN state, no logits rows
        return ForwardBatch(
            positions=positions, cu_seqlens=torch.arange(d + 1, device=positions.device),
            seq_lens=seq_lens, slot_mapping=slots, block_tables=tables,
            state_slots=no_rows, has_initial_state=no_rows.bool(), state_write_slots=no_rows.view(0, 1),
            logits_indices=no_rows, num_prefills=d, num_prefill_tokens=d, decode_len=1, kernels=kernels,
            attention=AttentionLayout(keys, (), slots_valid=True, query_len=1),
            decode_rows=None, chunks=None)


def _greedy(model: HybridForCausalLM, h: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(h).max(dim=-1).indices      # max: cheaper than argmax on CPU
