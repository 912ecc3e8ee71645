"""Decode and verify steps as CUDA graphs, one per (tokens per request L, batch-size bucket).

A step whose segments are all decodes of L tokens (L = 1 plain decode, 1 + k verify) has the
same shapes for every batch of B requests, so it can be captured once per bucket and replayed.
The rules:

- The graph reads the step builder's persistent buffers (step_inputs.py), where the step's
  real rows are packed in the first place; a run only pads the rows after them, up to the
  smallest bucket >= B, rewriting them on every run (never stale from a larger batch).
- Padding rows cannot touch any request's memory: token 0 at position 0 with KV length L
  (queries see block 0, which every pool has), KV slot -1 (write skipped), GDN state read
  from the cache's pad_slot, which no request owns, and write slots -1 (skipped). Their
  outputs are computed and dropped.
- Capture happens at warm-up only (`capture()`), largest bucket first, sharing one memory
  pool. Prefill and mixed steps, batches over the largest bucket and MoE models (their expert
  routing reads counts back to the host) run eagerly.
- Kernels inside a captured step must not synchronise with the host (no `.item()`, no
  `bool(tensor)`): the triton backend's decode path is written that way (the torch backend's
  skips a padding row's writes with a boolean mask, so it is not captured).
- The outputs are views of the graph's static outputs: consumed within the step.

Without CUDA (`capture=False`), the same padded buffers run eagerly: that is how the CPU tests
check the padding against the plain eager step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_engine.kernels.attention import attention_layout
from hybrid_engine.kernels.slot_pool import DecodeRows
from hybrid_engine.models import ForwardBatch, HybridForCausalLM
from hybrid_engine.state_cache import CachePools

from .model_runner import EagerSteps
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


class CudaGraphSteps(EagerSteps):
    def __init__(self, model: HybridForCausalLM, caches: CachePools, builder: StepInputBuilder,
                 decode_lens: Sequence[int], buckets: Sequence[int], capture: bool, warmup_runs: int = 2):
        super().__init__(model, caches)
        self.builder = builder
        self.decode_lens = sorted(set(decode_lens))
        self.buckets = sorted(set(buckets))
        self.use_graphs = capture
        self.warmup_runs = warmup_runs
        device = builder.input_ids.device
        # cu_seqlens of a step of L-token segments is L * [0, 1, ..., bucket]: padding rows
        # continue it from this table (no read-back of the real rows).
        self._steps = torch.arange(self.buckets[-1] + 1, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def bucket_for(self, batch_size: int) -> int | None:
        return next((b for b in self.buckets if b >= batch_size), None)

    def capture(self) -> None:
        """Warm up (compiling the kernels) and capture every (L, bucket), on all-padding inputs."""
        if not self.use_graphs:
            return
        pool, device = None, self.builder.input_ids.device
        for L in self.decode_lens:
            for bucket in reversed(self.buckets):
                self._pad(L, bucket, 0)
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(self.warmup_runs):
                        self._step(L, bucket)
                torch.cuda.current_stream(device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[L, bucket] = self._step(L, bucket)
                pool = graph.pool()
                self.graphs[L, bucket] = graph

    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (hidden [B*L, H], float32 logits [B*L, vocab]) of a decode step of B requests of L
        tokens each, through the graph of its bucket; other steps eagerly."""
        b = inputs.batch
        L, n = b.decode_len, b.num_decodes
        bucket = self.bucket_for(n)
        if (b.num_prefills or L not in self.decode_lens or bucket is None
                or b.logits_indices.numel() != inputs.input_ids.numel()):
            return super().forward(inputs)
        self._pad(L, bucket, n)
        if (L, bucket) in self.graphs:
            self.graphs[L, bucket].replay()
            outs = self.outputs[L, bucket]
        else:
            outs = self._step(L, bucket)
        return tuple(out[:L * n] for out in outs)

    def _pad(self, L: int, bucket: int, n: int) -> None:
        """Rows n..bucket of the builder's buffers, as a step of `bucket` L-token decodes reads
        them, set to their padding values."""
        b, t, end = self.builder, L * n, L * bucket
        b.input_ids[t:end].zero_()
        b.positions[t:end].zero_()
        b.slot_mapping[t:end].fill_(-1)
        b.cu_seqlens[n:bucket + 1].copy_(L * self._steps[n:bucket + 1])
        b.seq_lens[n:bucket].fill_(L)
        b.block_tables[n:bucket].zero_()
        b.state_slots[n:bucket].fill_(self.caches.pad_slot)
        b.state_write_slots[n:bucket, :L].fill_(-1)

    def _step(self, L: int, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward of a step of `bucket` L-token decodes over the builder's buffers."""
        b, end = self.builder, L * bucket
        seq_lens, tables = b.seq_lens[:bucket], b.block_tables[:bucket]
        batch = ForwardBatch(
            positions=b.positions[:end], cu_seqlens=b.cu_seqlens[:bucket + 1], seq_lens=seq_lens,
            slot_mapping=b.slot_mapping[:end], block_tables=tables, state_slots=b.state_slots[:bucket],
            has_initial_state=torch.ones(bucket, dtype=torch.bool, device=seq_lens.device),
            # every row samples: logits for all rows below, so the model needs no indices
            state_write_slots=b.state_write_slots[:bucket, :L], logits_indices=b.positions[:0],
            num_prefills=0, num_prefill_tokens=0, decode_len=L, kernels=b.kernels,
            attention=attention_layout(tables, seq_lens, [L] * bucket, b.block_size, slots_valid=False),
            decode_rows=PADDED_ROWS, chunks=None)
        hidden = self.model(b.input_ids[:end], batch, self.caches)
        return hidden, self.model.compute_logits(hidden).float()
