"""Packs a ScheduledBatch into the model's inputs, in buffers allocated once (seed 002).

Every tensor a forward reads lives in a persistent buffer (packed_buffers.py): a step writes
its values in place and hands the model views of the used prefix.

Segments are packed prefills first, then decodes. A decode is one token, or with
speculation 1 + k tokens: [last token, d1..dk]; its GDN state after position j is written
to write slot j = [committed slot, draft slot 1..k][j], so the committed state is only
replaced by choosing a slot after verification.

Steady state: when a step decodes exactly the requests of the last step, in the same order,
one token each (plain decode), only what changed is written: the new tokens, positions,
lengths and KV slots moved up by one in place, a block-table entry for a request that
entered a new block, and one column of the attention keys (each row's new key made visible;
PagedKeys' tails re-read the first key, so nothing else of them changes) unless the step's
attention reads no keys (the native CPU kernel: `keyless_query_lens`). The values are
written from the host in place (on CPU through numpy views of the buffers), so the step costs
a handful of ops whatever the batch. Anything else, or a step whose keys get wider, is packed
from scratch. Steps without keys widen their block tables to powers of two (`_table_width`),
so that most block boundaries keep the step's batch object too.

The step's facts that layers would otherwise derive in every layer, with reads back to the
host (ForwardBatch.attention, .decode_rows, .chunks), are computed here once, from the lists
the step is packed from. The MTP drafter's passes are packed into buffers of their own
(hybrid_engine/draft_inputs.py), so drafting never disturbs the steady state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hybrid_engine.kernels import KernelBackend, torch_backend
from hybrid_engine.kernels.attention import PagedKeys, attention_layout, reads_no_keys
from hybrid_engine.kernels.gdn.chunk import ChunkLayout
from hybrid_engine.kernels.slot_pool import DecodeRows
from hybrid_engine.models import ForwardBatch
from hybrid_engine.models.batch import GdnCaptures, PrefillPiece, RecurrentPrefill
from hybrid_engine.state_cache import HybridCacheManager, kv_slots

from .packed_buffers import PackedBuffers
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
    # prefix caching: (position, checkpoint entry) its GDN states are captured at (prefill only)
    captures: Sequence[tuple[int, int]] = ()


@dataclass
class PromptRows:
    """Rows of a prefill segment whose logits score its prompt (SamplingParams.prompt_logprobs):
    hidden row first_row + i predicts prompt token first_token + i. They go through lm_head
    after the forward (hybrid_engine/prompt_logprobs.py), not among the sampling rows."""

    segment: Segment
    first_row: int
    first_token: int
    num_rows: int


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    batch: ForwardBatch
    segments: list[Segment]
    # (segment, first logits row, number of logits rows) for each segment that samples
    sample_spans: list[tuple[Segment, int, int]]
    prompt_rows: list[PromptRows] = dataclasses.field(default_factory=list)


class StepInputBuilder(PackedBuffers):
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 block_size: int, num_speculative_tokens: int = 0, device: torch.device | str = "cpu",
                 keyless_query_lens: frozenset[int] = frozenset(), recurrent_prefill: bool = False,
                 kernels: KernelBackend | None = None):
        self.block_size = block_size
        # Prefill segments' GDN layers run by the decode kernel, in pieces between their
        # checkpoint captures (models/batch.py RecurrentPrefill), where it serves them
        # (KernelBackend.gdn_decode_serves_prefill); otherwise chunked. Fixed for the engine's life.
        self.recurrent_prefill = recurrent_prefill
        self.k = num_speculative_tokens
        # Steps and MTP passes whose sequences all have one of these numbers of new tokens get no
        # attention keys (KernelBackend.attention_reads_keys: the cpu backend's native kernel
        # reads the cache in place), and the steady state then has none to update. Fixed for
        # the engine's life, by its kernels.
        self.keyless_query_lens = keyless_query_lens
        # the engine's backend, fixed for its life and handed to every step
        self.kernels = torch_backend() if kernels is None else kernels
        # Decode graphs pad a step up to max_num_seqs rows of 1 + k tokens in these buffers, and
        # an MTP catch-up after prefix hits adds one position per request (the entry at L - 1).
        max_num_tokens = max(max_num_tokens + (max_num_seqs if self.k else 0), max_num_seqs * (1 + self.k))
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_num_tokens, **i64)
        # Rows of one buffer: positions, lengths, KV slots, and for the steady state (module
        # docstring) each row's offset in its last block and that block. A plain decode step
        # moves the first four on by one in one op; the last two, in the order of the keys'
        # (offsets, blocks), are the values of each row's new key column.
        self._moving = torch.zeros(5, max_num_tokens, **i64)
        self.positions, self.seq_lens, self.slot_mapping = self._moving[0], self._moving[1, :max_num_seqs], self._moving[2]
        self.cu_seqlens = torch.zeros(max_num_seqs + 1, **i64)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks_per_seq, **i64)
        self.state_slots = torch.zeros(max_num_seqs, **i64)
        self.has_initial_state = torch.zeros(max_num_seqs, dtype=torch.bool, device=device)
        self.state_write_slots = torch.zeros(max_num_seqs, 1 + self.k, **i64)
        self.logits_indices = torch.zeros(max_num_tokens, **i64)
        self._host_views(_BUFFERS, device)     # `_put` writes through them, and the steady state's add
        self._last_decode: _SteadyDecode | None = None   # the last step, if it was plain decode only

    def build(self, sched: ScheduledBatch, cache: HybridCacheManager) -> StepInputs:
        if not sched.prefills and self._last_decode is not None:
            inputs = self._advance_decodes(sched.decodes, cache)
            if inputs is not None:
                return inputs
        segments: list[Segment] = []
        row = 0
        for req, n in sched.prefills:
            start = req.num_computed_tokens
            segments.append(Segment(req, start, n, row, False, start + n == req.num_tokens,
                                    sched.captures.get(req.request_id, ())))
            row += n
        for req in sched.decodes:
            n = 1 + len(req.draft_token_ids)
            segments.append(Segment(req, req.num_computed_tokens, n, row, True, True))
            row += n
        inputs = self._pack(segments, len(sched.prefills), cache)
        self._last_decode = None
        if not sched.prefills and inputs.batch.decode_len == 1:       # plain decode
            bs, n = self.block_size, len(segments)
            blocks = [cache.get(s.request.request_id).block_table[s.start // bs] for s in segments]
            self._moving[4, :n].copy_(torch.tensor(blocks, dtype=torch.int64))
            self._moving[3, :n].copy_(inputs.batch.positions % bs)
            keys = inputs.batch.attention.keys
            self._last_decode = (self._steady(inputs, torch.stack([keys.offsets, keys.blocks]), keys.visible)
                                 if keys is not None else _SteadyDecode(inputs, self._moving[:4, :n]))
            inputs = self._last_decode.inputs
        return inputs

    def _steady(self, inputs: StepInputs, index: torch.Tensor, visible: torch.Tensor) -> _SteadyDecode:
        """The steady state's handles on a plain decode step: its inputs with attention keys
        whose offsets and blocks are the two halves of `index` [2, n, L] (so one scatter writes
        a column of both), and `visible` their mask."""
        n = len(inputs.segments)
        attention = dataclasses.replace(inputs.batch.attention, keys=PagedKeys(index[1], index[0], visible.view(n, 1, 1, -1)))
        inputs = dataclasses.replace(inputs, batch=dataclasses.replace(inputs.batch, attention=attention))
        moving = self._moving[:, :n]
        column = moving[0, :, None]                                       # [n, 1]: each row's position
        return _SteadyDecode(inputs, moving[:4], index, column.expand(2, n, 1), moving[3:5, :, None],
                             visible.view(n, -1), column)

    def _advance_decodes(self, decodes: list[Request], cache: HybridCacheManager) -> StepInputs | None:
        """The steady state (module docstring), or None when the batch is not the last one moved
        on by one token. cu_seqlens, state slots, write slots and logits rows stay as they are:
        without drafts a running request never changes its state slot or its earlier blocks."""
        last = self._last_decode
        if len(decodes) != len(last.inputs.segments):
            return None
        bs = self.block_size
        segments, ids, new_blocks = [], [], []
        for row, (req, prev) in enumerate(zip(decodes, last.inputs.segments)):
            start = req.num_computed_tokens
            if req is not prev.request or start != prev.start + 1 or req.draft_token_ids:
                return None
            ids.extend(req.token_ids_in(start, start + 1))
            if start % bs == 0:
                new_blocks.append((row, start // bs, cache.get(req.request_id).block_table[start // bs]))
            segments.append(Segment(req, start, 1, row, True, True))
        n, batch = len(segments), last.inputs.batch      # its views read the buffers changed below
        self._put(("input_ids", ids))
        if self._host is not None:
            self._host["_moving"][:4, :n] += 1           # positions, seq_lens, slot_mapping, offsets
        else:
            last.moving.add_(1)
        if new_blocks:
            old_width = batch.block_tables.shape[1]
            batch = self._enter_blocks(batch, new_blocks, keyless=last.key_index is None)
            if batch.block_tables.shape[1] > old_width and last.key_index is not None:
                # Wider keys: the new columns are tails, which re-read the first key: the
                # offset and block of column 0 (position 0 is always visible), and hidden.
                extra = (batch.block_tables.shape[1] - old_width) * bs
                index = torch.cat([last.key_index, last.key_index[:, :, :1].expand(2, n, extra)], 2)
                visible = torch.cat([last.visible, last.visible.new_zeros(n, extra)], 1)
                last = self._last_decode = self._steady(StepInputs(last.inputs.input_ids, batch, segments, []),
                                                        index, visible)
                batch = last.inputs.batch
        if last.key_index is not None:
            # Each row's new key, at column = its position: its offset and block, and visible.
            last.key_index.scatter_(2, last.key_column, last.key_values)
            last.visible.scatter_(1, last.position, True)
        inputs = StepInputs(last.inputs.input_ids, batch, segments, [(s, s.first_row, 1) for s in segments])
        last.inputs = inputs
        return inputs

    def _enter_blocks(self, batch: ForwardBatch, new_blocks: list[tuple[int, int, int]], keyless: bool
                      ) -> ForwardBatch:
        """Rows that entered a new block at this step's position: its block-table entry, the
        row's last block, and its KV slot and offset (moved on by one from the last block's end)
        at the new block's start. The table's view is widened only past its last column
        (`_table_width`): within it, the step keeps its batch object."""
        old_width = batch.block_tables.shape[1]
        width = max(col for _, col, _ in new_blocks) + 1
        if width > old_width:
            width = self._table_width(width, keyless)
            batch = dataclasses.replace(batch, block_tables=self.block_tables[:batch.seq_lens.shape[0], :width])
            batch.block_tables[:, old_width:].zero_()   # stale columns from an earlier, wider step
        T, width = self._moving.shape[1], self.block_tables.shape[1]
        table_at = [row * width + col for row, col, _ in new_blocks]
        # The row's KV slot, offset and last block (rows 2, 3, 4 of the moving buffer).
        moving_at = [i * T + row for row, _, _ in new_blocks for i in (2, 3, 4)]
        blocks = [block for _, _, block in new_blocks]
        values = blocks + [v for b in blocks for v in (b * self.block_size, 0, b)]
        written = torch.tensor(table_at + moving_at + values, dtype=torch.int64, device=self.block_tables.device)
        m = len(blocks)
        self.block_tables.view(-1).index_copy_(0, written[:m], written[4 * m:5 * m])
        self._moving.view(-1).index_copy_(0, written[m:4 * m], written[5 * m:])
        return batch

    def _pack(self, segments: list[Segment], num_prefills: int, cache: HybridCacheManager) -> StepInputs:
        # Plain lists per buffer, then one tensor and one in-place copy each: per-token and
        # per-segment torch calls cost more than the forward of a small model.
        bs = self.block_size
        decode_len = segments[-1].num_tokens if len(segments) > num_prefills else 1
        ids, positions, slots, cu, seq_lens, state_slots, has_init = [], [], [], [0], [], [], []
        tables, write_slots, logits_rows, spans, query_lens, prompt_rows = [], [], [], [], [], []
        for seg in segments:
            req, start, n = seg.request, seg.start, seg.num_tokens
            end = start + n
            rc = cache.get(req.request_id)
            ids.extend(req.token_ids_in(start, start + 1 if seg.is_decode else end))
            if seg.is_decode:
                if n != decode_len:
                    raise RuntimeError("decode segments of one step must all have the same length")
                ids.extend(req.draft_token_ids)
                write_slots.extend(rc.write_slots(n))
            positions.extend(range(start, end))
            slots.extend(kv_slots(rc.block_table, start, end, bs))
            cu.append(cu[-1] + n)
            seq_lens.append(end)
            state_slots.append(rc.slot)
            has_init.append(start > 0)     # per request: GDN state exists iff it cached tokens
            tables.append(rc.block_table)
            query_lens.append(n)
            scored = req.prompt_positions_to_score(start, end)
            if scored:
                prompt_rows.append(PromptRows(seg, seg.first_row + scored.start - start, scored.start + 1, len(scored)))
            if seg.samples:
                # A prefill samples from its last token; a decode/verify from all of its tokens.
                first = seg.first_row if seg.is_decode else seg.first_row + n - 1
                spans.append((seg, len(logits_rows), n if seg.is_decode else 1))
                logits_rows.extend(range(first, seg.first_row + n))
        t, n_seq, n_dec = len(ids), len(segments), len(segments) - num_prefills
        keyless = reads_no_keys(query_lens, self.keyless_query_lens)
        max_blocks = self._table_width(max(len(tb) for tb in tables), keyless)
        padded_tables = []
        for tb in tables:
            padded_tables.extend(tb)
            padded_tables.extend([0] * (max_blocks - len(tb)))
        bt, wr = self._put(("block_tables", padded_tables, max_blocks), ("state_write_slots", write_slots, decode_len),
                           ("input_ids", ids), ("positions", positions), ("slot_mapping", slots), ("cu_seqlens", cu),
                           ("seq_lens", seq_lens), ("state_slots", state_slots), ("has_initial_state", has_init),
                           ("logits_indices", logits_rows))[:2]
        seq_lens_t = self.seq_lens[:n_seq]
        read = state_slots[num_prefills:]
        batch = ForwardBatch(
            positions=self.positions[:t], cu_seqlens=self.cu_seqlens[:n_seq + 1],
            seq_lens=seq_lens_t, slot_mapping=self.slot_mapping[:t], block_tables=bt,
            state_slots=self.state_slots[:n_seq], has_initial_state=self.has_initial_state[:n_seq],
            state_write_slots=wr, logits_indices=self.logits_indices[:len(logits_rows)],
            num_prefills=num_prefills, num_prefill_tokens=cu[num_prefills], decode_len=decode_len,
            kernels=self.kernels,
            attention=attention_layout(bt, seq_lens_t, query_lens, bs, slots_valid=True,
                                       keyless=self.keyless_query_lens),
            decode_rows=DecodeRows.of_lists(read, [write_slots[i:i + decode_len]
                                                   for i in range(0, len(write_slots), decode_len)])
            if n_dec else None,
            chunks=ChunkLayout(query_lens[:num_prefills], device=self.positions.device,
                               cuts=[[p - seg.start for p, _ in seg.captures] for seg in segments[:num_prefills]])
            if num_prefills and not self.recurrent_prefill else None,
            gdn_captures=self._gdn_captures(segments[:num_prefills]),
            recurrent_prefill=self._recurrent_prefill(segments[:num_prefills], cache)
            if num_prefills and self.recurrent_prefill else None,
        )
        return StepInputs(self.input_ids[:t], batch, segments, spans, prompt_rows)

    def _recurrent_prefill(self, prefills: list[Segment], cache: HybridCacheManager) -> RecurrentPrefill:
        """The prefill segments cut into pieces at their captures (in the order of _gdn_captures),
        with all of their slots in one tensor."""
        bounds, slots, fresh, capture = [], [], [], 0
        for seg in prefills:
            slot = cache.get(seg.request.request_id).slot
            if seg.start == 0:
                fresh.append(slot)
            cuts = [p - seg.start for p, _ in seg.captures]      # ascending, in (0, num_tokens]
            ends = cuts + ([seg.num_tokens] if not cuts or cuts[-1] < seg.num_tokens else [])
            start = 0
            for i, end in enumerate(ends):
                bounds.append((seg.first_row + start, end - start, capture + i if i < len(cuts) else None))
                slots.extend([slot] + [-1] * (end - start - 1) + [slot])
                start = end
            capture += len(cuts)
        values = torch.tensor(slots + fresh, dtype=torch.int64, device=self.positions.device)
        pieces, at = [], 0
        for first, n, cap in bounds:
            pieces.append(PrefillPiece(first, n, values[at:at + 1], values[at + 1:at + 1 + n].view(1, n), cap))
            at += 1 + n
        return RecurrentPrefill(tuple(pieces), values[at:] if fresh else None)

    def _gdn_captures(self, prefills: list[Segment]) -> GdnCaptures | None:
        """The prefill segments' checkpoint captures, in the order of the chunk layout's cuts."""
        caps = [(i, seg.first_row + p - seg.start, entry)
                for i, seg in enumerate(prefills) for p, entry in seg.captures]
        if not caps:
            return None
        seqs, ends, entries = torch.tensor(caps, dtype=torch.int64, device=self.positions.device).unbind(1)
        return GdnCaptures(seqs=seqs, ends=ends, entries=entries)


# The builder's buffers, by attribute name (StepInputBuilder._put writes them).
_BUFFERS = ("input_ids", "_moving", "positions", "seq_lens", "slot_mapping", "cu_seqlens", "block_tables",
            "state_slots", "has_initial_state", "state_write_slots", "logits_indices")


@dataclass
class _SteadyDecode:
    """The last step, when it was plain decode only, and the views the steady state writes
    (the key fields None when its attention has no keys: `keyless_query_lens`)."""

    inputs: StepInputs
    moving: torch.Tensor        # [4, n]: positions, seq_lens, slot_mapping, offsets in the last block
    key_index: torch.Tensor | None = None     # [2, n, L]: the attention keys' offsets and blocks
    key_column: torch.Tensor | None = None    # [2, n, 1]: each row's position, for both
    key_values: torch.Tensor | None = None    # [2, n, 1]: each row's offset in its last block, and that block
    visible: torch.Tensor | None = None       # [n, L]: the keys' mask
    position: torch.Tensor | None = None      # [n, 1]

