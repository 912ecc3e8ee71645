"""Decode and verify steps of the model as CUDA graphs, one per (tokens per request, batch bucket).

A step whose segments are all decodes of L tokens (L = 1 plain decode, 1 + k verify) has
the same shapes for every batch of B requests, so ModelRunner sends it here: its inputs,
which the step-input builder packed into its persistent buffers, are padded there up to the
bucket with rows that cannot touch any request's memory (hybrid_engine/cuda_graphs.py), and
the graph captured for that bucket at warm-up, over those same buffers, is replayed. Prefill and mixed steps, batches over the largest bucket and MoE
models (their expert routing reads counts back to the host) stay eager.

Padding rows: token 0 at position 0 with KV length L (queries see block 0, which every
pool has), KV slot -1 (write skipped), GDN state read from the cache's pad_slot, which no
request owns, and write slots -1 (skipped). Their outputs are computed and dropped.

Without CUDA (`capture=False`), the same padded buffers run eagerly: that is how the CPU
tests check the padding and the input copy against the plain eager step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_engine.kernels.attention import attention_layout
from hybrid_engine.kernels.slot_pool import DecodeRows
from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.state_cache import HybridCacheManager

from .cuda_graphs import BufferSpec, StepGraphs
from .step_inputs import StepInputBuilder, StepInputs

# Padding rows share the pad slot and skip their writes, so a graph (captured once for any
# number of real rows) holds neither independent rows nor only valid write slots.
PADDED_ROWS = DecodeRows(writes_valid=False, independent=False, in_place=False)


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (vLLM's spacing), and max_num_seqs itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sizes + [max_num_seqs]


def graphs_supported(model: HybridForCausalLM) -> bool:
    return model.cfg.num_experts == 0


class DecodeGraphs:
    """One StepGraphs per decode length L (1, and 1 + k with speculation), sharing the buckets."""

    def __init__(self, model: HybridForCausalLM, cache: HybridCacheManager, builder: StepInputBuilder,
                 decode_lens: Sequence[int], buckets: Sequence[int], capture: bool):
        self.model = model
        self.cache = cache
        self.builder = builder
        self.device = builder.input_ids.device
        self.max_bucket = max(buckets)
        max_blocks = builder.block_tables.shape[1]
        self.graphs = {L: StepGraphs(self._step_fn(L), self._specs(L, max_blocks), buckets, self.device,
                                     output_rows_per_request=L, use_graphs=capture, buffers=self._buffers(L))
                       for L in sorted(set(decode_lens))}

    def capture(self) -> None:
        for graphs in self.graphs.values():
            graphs.capture()

    def handles(self, inputs: StepInputs) -> bool:
        b = inputs.batch
        graphs = self.graphs.get(b.decode_len)
        return (b.num_prefills == 0 and graphs is not None and graphs.bucket_for(b.num_decodes) is not None
                and b.logits_indices.numel() == inputs.input_ids.numel())

    def run(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [B*L, H], float32 logits [B*L, vocab]): views of static outputs, valid
        until the next step. The inputs are the builder's, so they already lie in the buffers."""
        b = inputs.batch
        return self.graphs[b.decode_len].run(b.num_decodes)

    def _buffers(self, L: int) -> dict[str, torch.Tensor]:
        """The builder's persistent buffers, as the graphs for L tokens per request read them."""
        b = self.builder
        return {"input_ids": b.input_ids, "positions": b.positions, "slot_mapping": b.slot_mapping,
                "cu_seqlens": b.cu_seqlens, "seq_lens": b.seq_lens, "block_tables": b.block_tables,
                "state_slots": b.state_slots, "state_write_slots": b.state_write_slots[:, :L]}

    def _specs(self, L: int, max_blocks: int) -> dict[str, BufferSpec]:
        i64 = torch.int64

        # Every segment has L tokens, so cu_seqlens is L * [0, 1, ..., bucket]: padded rows
        # continue it from a table (no read-back of the real rows).
        steps = L * torch.arange(self.max_bucket + 1, dtype=i64, device=self.device)

        def cu_pad(view: torch.Tensor, real: int) -> None:
            view[real:].copy_(steps[real:view.shape[0]])

        return {
            "input_ids": BufferSpec((), i64, pad=0, rows_per_request=L),
            "positions": BufferSpec((), i64, pad=0, rows_per_request=L),
            "slot_mapping": BufferSpec((), i64, pad=-1, rows_per_request=L),
            "cu_seqlens": BufferSpec((), i64, pad=cu_pad, extra_rows=1),
            "seq_lens": BufferSpec((), i64, pad=L),
            "block_tables": BufferSpec((max_blocks,), i64, pad=0),
            "state_slots": BufferSpec((), i64, pad=self.cache.pools.pad_slot),
            "state_write_slots": BufferSpec((L,), i64, pad=-1),
        }

    def _step_fn(self, L: int):
        block_size = self.builder.block_size

        def step(v: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            n = v["seq_lens"].shape[0]
            layout = attention_layout(v["block_tables"], v["seq_lens"], [L] * n, block_size, slots_valid=False)
            batch = ForwardBatch(
                positions=v["positions"], cu_seqlens=v["cu_seqlens"], seq_lens=v["seq_lens"],
                slot_mapping=v["slot_mapping"], block_tables=v["block_tables"], state_slots=v["state_slots"],
                has_initial_state=torch.ones(n, dtype=torch.bool, device=v["seq_lens"].device),
                # every row samples: logits for all rows below, so the model needs no indices
                state_write_slots=v["state_write_slots"], logits_indices=v["positions"][:0],
                num_prefills=0, num_prefill_tokens=0, decode_len=L, kernels=self.builder.kernels,
                attention=layout, decode_rows=PADDED_ROWS, chunks=None)
            hidden = self.model(v["input_ids"], batch, self.cache.pools)
            return hidden, self.model.compute_logits(hidden).float()
        return step
