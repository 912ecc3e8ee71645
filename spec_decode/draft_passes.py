"""One step's MTP drafting as one function: the catch-up pass, then the k-1 one-token passes.

Draft pass j (1..k-1) feeds each drafting request's draft j with the MTP's own output hidden
state at position p + j, where p is the position of its last committed token (the catch-up
row it drafts from). Its metadata is the catch-up pass's, moved on: the same block tables,
positions p + j, KV slots block_table[pos // block_size] * block_size + pos % block_size
(state_cache.kv_slots), lengths p + j + 1. It is computed here in torch from the catch-up
batch's tensors (its block tables packed wider: DraftInputBuilder.build's lookahead)
rather than packed on the host for every pass, so that the whole of
drafting is one call: one graph (one dynamo entry) when compiled, and no host packing between
the passes when eager. The eager and compiled forms run this same code.

The k-1 passes' positions, KV slots, lengths and RoPE tables are computed together, once per
step, as [k-1, D] tensors whose rows the passes take (`pass_batches`): made per pass, their
small ops were a tenth of the passes' time in an eager step at the default model's size
(benchmarks/history/RESULTS_LOG.md).

Under tensor parallelism every rank runs these passes (hybrid_engine/tensor_parallel.py), but
only rank 0 holds a pass's whole logits (lm_head's vocabulary parts are gathered there), so
`share` hands each pass's drafts from rank 0 to every rank: the next pass embeds them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from hybrid_engine.kernels import KernelBackend
from hybrid_engine.kernels.attention import AttentionLayout, paged_keys
from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.models.batch import LayerCaches
from hybrid_engine.request_grammar import DraftMasks


@dataclass(frozen=True)
class DraftPasses:
    num_drafts: int     # k
    block_size: int
    # One-token passes' attention reads no PagedKeys (the native CPU kernel serves them:
    # StepInputBuilder.keyless_query_lens), so none are made for them.
    keyless: bool
    # Tensor parallelism: a pass's drafts [D] -> rank 0's drafts, on every rank (None: one process).
    share: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __call__(self, model: HybridForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor,
                 batch: ForwardBatch, caches: LayerCaches, tables: torch.Tensor, rows: torch.Tensor,
                 seqs: torch.Tensor, masks: DraftMasks | None = None) -> torch.Tensor:
        """The catch-up pass over `batch` (tokens [T] = token i+1, hidden [T, H] = the target's
        h_i), then the k-1 draft passes of the drafting requests: their catch-up rows `rows`
        [D] and sequences `seqs` [D] in `batch` -> the drafts [D, k]. tables: the batch's
        sequences' block tables covering the positions up to p + k - 1 of those that draft.
        masks: the drafting requests' grammars (hybrid_engine/request_grammar.py), eager only:
        each pass's drafts go to the host for the next pass's masks."""
        h, draft = self.catch_up(model, tokens, hidden, batch, caches, rows, masks)
        return self.continued(model, draft, h, batch.positions.index_select(0, rows),
                              tables.index_select(0, seqs), batch.kernels, caches, masks)

    def catch_up(self, model: HybridForCausalLM, tokens: torch.Tensor, hidden: torch.Tensor,
                 batch: ForwardBatch, caches: LayerCaches, rows: torch.Tensor, masks: DraftMasks | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up pass -> (its output hidden at `rows`, draft 1 from each of them)."""
        h = model.mtp_forward(tokens, hidden, batch, caches).index_select(0, rows)
        return h, self._greedy(model, h, masks)

    def continued(self, model: HybridForCausalLM, draft: torch.Tensor, h: torch.Tensor, last: torch.Tensor,
                  tables: torch.Tensor, kernels: KernelBackend, caches: LayerCaches,
                  masks: DraftMasks | None = None) -> torch.Tensor:
        """Draft passes 2..k after the catch-up: draft 1 [D] and its hidden [D, H] at positions
        `last` [D] over the drafting requests' `tables` [D, W] -> the drafts [D, k]."""
        drafts = [draft]
        for batch, rope in self.pass_batches(model, last, tables, kernels, h.dtype):
            h = model.mtp_forward(draft, h, batch, caches, rope)
            draft = self._greedy(model, h, masks)
            drafts.append(draft)
        return torch.stack(drafts, dim=1)

    def pass_batches(self, model: HybridForCausalLM, last: torch.Tensor, tables: torch.Tensor,
                     kernels: KernelBackend, dtype: torch.dtype
                     ) -> list[tuple[ForwardBatch, tuple[torch.Tensor, torch.Tensor]]]:
        """Passes 2..k of the drafting requests at positions `last` [D] over `tables` [D, W]:
        for pass j a one-token pass of each at last + j (what DraftInputBuilder.build packs
        for segments (last + j, 1, table)), with its RoPE tables in `dtype`."""
        if self.num_drafts < 2:
            return []
        bs = self.block_size
        d = last.shape[0]
        offsets = torch.arange(1, self.num_drafts, device=last.device)
        positions = last[None, :] + offsets[:, None]                         # [k-1, D]
        blocks = tables.gather(1, (positions // bs).t()).t().contiguous()   # [k-1, D]: each pass's row contiguous
        slots = blocks * bs + positions % bs
        seq_lens = positions + 1
        cos, sin = (t.view(self.num_drafts - 1, d, -1).unbind(0) for t in model.rope(positions.reshape(-1), dtype))
        cu_seqlens = torch.arange(d + 1, device=last.device)
        no_rows = last[:0]              # the MTP layer is attention only: no GDN state, no logits rows
        no_initial, no_writes = no_rows.bool(), no_rows.view(0, 1)
        batches = []
        for pos, slot, lens, rope in zip(positions.unbind(0), slots.unbind(0), seq_lens.unbind(0), zip(cos, sin)):
            keys = None if self.keyless else paged_keys(tables, lens, 1, bs)
            batch = ForwardBatch(
                positions=pos, cu_seqlens=cu_seqlens, seq_lens=lens, slot_mapping=slot, block_tables=tables,
                state_slots=no_rows, has_initial_state=no_initial, state_write_slots=no_writes,
                logits_indices=no_rows, num_prefills=d, num_prefill_tokens=d, decode_len=1, kernels=kernels,
                attention=AttentionLayout(keys, (), slots_valid=True, query_len=1),
                decode_rows=None, chunks=None)
            batches.append((batch, rope))
        return batches

    def _greedy(self, model: HybridForCausalLM, h: torch.Tensor, masks: DraftMasks | None = None) -> torch.Tensor:
        logits = model.compute_logits(h)
        if masks is not None:
            logits = masks.apply(logits)
        drafts = logits.max(dim=-1).indices    # max: cheaper than argmax on CPU
        if self.share is not None:
            drafts = self.share(drafts)
        if masks is not None:
            masks.advance(drafts.tolist())
        return drafts
