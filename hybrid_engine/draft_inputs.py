"""Packs one step's MTP drafting (spec_decode/mtp_drafter.py) into buffers of its own.

Drafting is a catch-up pass over the positions each request just committed, then k-1
one-token passes (spec_decode/draft_passes.py). What the catch-up reads is packed here from
host lists, as the step builder packs a step, but into a second set of persistent buffers:
drafting never overwrites the step's, so the step builder's steady state survives it, and a
drafting call whose inputs lie at the same addresses as an earlier one's can replay its
compiled graph (compiled_steps.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.kernels import KernelBackend
from hybrid_engine.kernels.attention import attention_layout, reads_no_keys
from hybrid_engine.models import ForwardBatch
from hybrid_engine.state_cache import kv_slots

from .packed_buffers import PackedBuffers


@dataclass
class DraftInputs:
    tokens: torch.Tensor     # [T] token i+1 for each catch-up position i
    hidden: torch.Tensor     # [T, H] the target's final-normed hidden state h_i
    batch: ForwardBatch      # the catch-up pass (the MTP layer is attention only: no GDN fields)
    tables: torch.Tensor     # [N, W] the segments' block tables, covering the draft passes' positions too
    rows: torch.Tensor       # [D] the catch-up rows the drafting requests draft from
    seqs: torch.Tensor       # [D] their sequences in `batch`
    # Every segment has the same length, at most k + 1 (a decode's catch-up): one graph when compiled.
    one_length: bool


class DraftInputBuilder(PackedBuffers):
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 num_speculative_tokens: int, device: torch.device | str, keyless_query_lens: frozenset[int],
                 kernels: KernelBackend):
        self.block_size = block_size
        self.k = num_speculative_tokens
        self.keyless_query_lens = keyless_query_lens
        self.kernels = kernels
        # A prompt chunk's catch-up, plus one position per request after a prefix hit (the MTP
        # entry at L - 1); a verify's is at most k + 1 a request.
        t = max(max_num_tokens, max_num_seqs * (self.k + 1)) + max_num_seqs
        i64 = dict(dtype=torch.int64, device=device)
        self.tokens, self.positions, self.slot_mapping = torch.zeros(3, t, **i64)
        self.cu_seqlens = torch.zeros(max_num_seqs + 1, **i64)
        self.seq_lens, self.rows, self.seqs = torch.zeros(3, max_num_seqs, **i64)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **i64)
        self._host_views(("tokens", "positions", "slot_mapping", "cu_seqlens", "seq_lens", "rows", "seqs",
                          "block_tables"), device)
        self._hidden: torch.Tensor | None = None     # a decode-sized catch-up's hidden rows, staged
        self._max_one_length_rows = max_num_seqs * (self.k + 1)
        # the GDN and logits fields of a catch-up, empty (fixed objects: compiled_steps.same_views)
        self._no_rows, self._no_initial = torch.zeros(0, **i64), torch.zeros(0, dtype=torch.bool, device=device)
        self._no_writes = torch.zeros(0, 1, **i64)

    def build(self, segs: list[tuple[int, int, list[int]]], tokens: list[int], hidden: torch.Tensor,
              drafting: list[int], lookahead: int) -> DraftInputs:
        """segs: (start, length, block table) per request; tokens: their next tokens, in order;
        hidden [T, H]: the target's rows; drafting: the indices of the segments that draft.
        The block tables cover `lookahead` positions past each segment too (the draft passes
        read them there); the catch-up's own attention reads the narrower view: the same
        blocks as without lookahead, so the same result to the last bit."""
        bs = self.block_size
        positions, slots, cu, seq_lens, tables, ends = [], [], [0], [], [], []
        for start, n, table in segs:
            positions.extend(range(start, start + n))
            slots.extend(kv_slots(table, start, start + n, bs))
            cu.append(cu[-1] + n)
            ends.append(cu[-1] - 1)
            seq_lens.append(start + n)
            tables.append(table[:(start + n + lookahead + bs - 1) // bs])
        t, n_seq = len(positions), len(segs)
        # The draft passes read `tables` (one query each), the catch-up `bt`: each as wide as its
        # attention needs, or bucketed where it reads no keys (`_table_width`).
        lengths = [n for _, n, _ in segs]
        keyless = self.keyless_query_lens
        width = self._table_width(max(len(tb) for tb in tables), reads_no_keys([1], keyless))
        read_width = min(width, self._table_width((max(seq_lens) + bs - 1) // bs, reads_no_keys(lengths, keyless)))
        padded = [b for tb in tables for b in tb + [0] * (width - len(tb))]
        tables_t, tokens_t, rows, seqs = self._put(
            ("block_tables", padded, width), ("tokens", tokens), ("rows", [ends[i] for i in drafting]),
            ("seqs", drafting), ("positions", positions), ("slot_mapping", slots), ("cu_seqlens", cu),
            ("seq_lens", seq_lens))[:4]
        one_length = len(set(lengths)) == 1 and lengths[0] <= self.k + 1
        if one_length:
            hidden = self._stage(hidden)
        bt = tables_t[:, :read_width]
        no_rows = self._no_rows
        batch = ForwardBatch(
            positions=self.positions[:t], cu_seqlens=self.cu_seqlens[:n_seq + 1],
            seq_lens=self.seq_lens[:n_seq], slot_mapping=self.slot_mapping[:t], block_tables=bt,
            state_slots=no_rows, has_initial_state=self._no_initial, state_write_slots=self._no_writes,
            logits_indices=no_rows, num_prefills=n_seq, num_prefill_tokens=t, decode_len=1, kernels=self.kernels,
            attention=attention_layout(bt, self.seq_lens[:n_seq], lengths, bs, slots_valid=True, keyless=keyless),
            decode_rows=None, chunks=None)
        return DraftInputs(tokens_t, hidden, batch, tables_t, rows, seqs, one_length)

    def _stage(self, hidden: torch.Tensor) -> torch.Tensor:
        """A decode-sized catch-up's hidden rows, copied into a persistent buffer: the same
        number of rows at the next call then lies at the same address."""
        buf = self._hidden
        if buf is None or buf.dtype != hidden.dtype or buf.shape[1:] != hidden.shape[1:]:
            buf = self._hidden = hidden.new_empty((self._max_one_length_rows, *hidden.shape[1:]))
        return buf[:hidden.shape[0]].copy_(hidden)
