"""The per-step metadata every layer reads, defined on the models side and filled by the engine.

A step packs the tokens of N sequences into one `[T]` stream. The first `num_prefills`
sequences are prefill segments of any length (a whole prompt or one chunk of it); the
remaining ones are decode segments of exactly `decode_len` tokens each (1 for plain decode,
k+1 when verifying k drafts). GDN layers send the two groups to different kernels: chunked
varlen for prefill (or, with `recurrent_prefill`, the decode kernel in pieces), the recurrent
pool kernel for decode (never padded into chunks).

`kernels` is the engine's kernel backend, chosen once at its construction. The last three
fields are the step's facts that every layer of one kind would otherwise derive
again (or read back from the device): built once by the engine from the host-side lists it
packed the step from, and handed to the kernels as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from hybrid_engine.kernels import KernelBackend
from hybrid_engine.kernels.attention import AttentionLayout
from hybrid_engine.kernels.gdn.chunk import ChunkLayout
from hybrid_engine.kernels.slot_pool import DecodeRows


@dataclass
class ForwardBatch:
    positions: torch.Tensor          # [T] int64, absolute token positions (RoPE)
    cu_seqlens: torch.Tensor         # [N+1] int64, segment boundaries in the packed stream
    seq_lens: torch.Tensor           # [N] int64, KV length of each sequence after this step
    slot_mapping: torch.Tensor       # [T] int64, flat KV slot (block * block_size + offset) per token
    block_tables: torch.Tensor       # [N, max_blocks] int64
    state_slots: torch.Tensor        # [N] int64, committed GDN state slot read by each sequence
    has_initial_state: torch.Tensor  # [N] bool, False for a sequence's first prefill chunk
    state_write_slots: torch.Tensor  # [N - num_prefills, decode_len] int64, where the GDN state after
                                     # each decode token is written (the committed slot for plain decode)
    logits_indices: torch.Tensor     # [M] int64, token rows whose logits are needed
    num_prefills: int
    num_prefill_tokens: int
    decode_len: int
    kernels: KernelBackend           # the ops every layer calls
    attention: AttentionLayout       # key positions and masks, shared by every attention layer
    decode_rows: DecodeRows | None   # the decode segments' GDN slot facts (None: no decodes)
    chunks: ChunkLayout | None       # the prefill segments' GDN chunk layout (None: no prefills)
    gdn_captures: GdnCaptures | None = None   # GDN states to checkpoint inside prefill segments
    # The prefill segments' GDN layers run by the decode kernel instead of the chunked form
    # (None: chunked, `chunks` then holds their layout).
    recurrent_prefill: RecurrentPrefill | None = None

    @property
    def num_decodes(self) -> int:
        return self.cu_seqlens.numel() - 1 - self.num_prefills


@dataclass
class GdnCaptures:
    """The GDN states a step's prefill segments leave in prefix checkpoints at positions inside
    them (docs: hybrid_engine/prefix_caching.py). Capture c is the conv window and recurrent
    state of prefill segment seqs[c] after its packed rows before ends[c], written to checkpoint
    entry entries[c]. Captures are in the order of `chunks.cuts` (segment by segment,
    ascending), whose chunk boundaries lie at exactly these positions."""

    seqs: torch.Tensor               # [C] int64, prefill segment of each capture
    ends: torch.Tensor               # [C] int64, packed row just past the captured position
    entries: torch.Tensor            # [C] int64, checkpoint entry written


@dataclass(frozen=True)
class PrefillPiece:
    """A run of one prefill segment's tokens between its checkpoint captures, for the decode
    kernel (kernels.gdn_decode) as one row of num_tokens tokens: it reads the segment's state
    slot and writes it back after the last token only (write slot -1, skipped, before that)."""

    first_row: int                   # packed row of the piece's first token
    num_tokens: int
    read_slots: torch.Tensor         # [1] int64: the segment's state slot
    write_slots: torch.Tensor        # [1, num_tokens] int64: -1 ..., then the slot
    capture: int | None              # index of the GdnCaptures capture taken after the piece


@dataclass(frozen=True)
class RecurrentPrefill:
    """Prefill segments run token by token by the decode kernel (kernels.decode_kernel_serves_prefill
    says where), as pieces in packing order; segments with no initial state start from zeros."""

    pieces: tuple[PrefillPiece, ...]
    fresh_slots: torch.Tensor | None     # [F] int64: state slots of the segments zeroed first


class LayerCaches(Protocol):
    """What a forward needs from the cache owner (state_cache.CachePools: HybridCacheManager.pools).

    kv_caches[i]: the i-th full-attention layer's `[num_blocks, 2, block_size, nkv, hd]`
    (the MTP layer's cache comes after the main model's); conv_states[j] /
    recurrent_states[j]: the j-th GDN layer's slot pools; checkpoint_conv_states[j] /
    checkpoint_recurrent_states[j]: its prefix checkpoint entries (ForwardBatch.gdn_captures).
    """

    kv_caches: list[torch.Tensor]
    conv_states: list[torch.Tensor]
    recurrent_states: list[torch.Tensor]
    checkpoint_conv_states: list[torch.Tensor]
    checkpoint_recurrent_states: list[torch.Tensor]
