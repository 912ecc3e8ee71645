"""HybridCacheManager: the one owner of all cache memory and of who holds which part of it.

Two pools, sized once at start-up:
- KV blocks, shared by every full-attention layer (the MTP layer included): a request holds
  a block table long enough for the tokens it has asked for.
- GDN state slots (conv window + recurrent state of every GDN layer): a request holds one
  committed slot, plus draft slots while it speculates, so that verification writes the
  state after each draft position without touching the committed one.

A request is admitted only if both kinds fit. Every verb checks before it changes anything:
a refused call (CacheCapacityError, ValueError, KeyError) leaves the manager as it was.

`fork` gives a new request its own copy of what another has committed (the n samples of one
prompt share its prefill this way: hybrid_engine/request_group.py).

Each outcome of a step has one verb: `commit` (a prefill chunk or a plain decode was
written), `commit_verify` (a verify step: the KV length and the committed GDN slot move
together, so no half-done rewind can exist), `free` (finished or preempted). A request's
blocks past its committed length stay with it while it runs: the next step's drafts and
verify reuse them instead of giving them back and taking them again.

One extra slot, `pad_slot`, belongs to no request: the padding rows of a CUDA-graph decode
step (hybrid_engine/decode_graphs.py) read it and write nowhere, so a padded row can never
race a real row for a state. It is part of the pools and of the byte budget.

Slot contents are NOT zeroed on allocate: a new slot holds whatever its last owner left.
The model must treat a request's first prefill chunk as having no initial state (the
per-request has_initial_state flag) and overwrite the slot, never read it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .block_allocator import BlockAllocator
from .errors import CacheCapacityError
from .slot_allocator import SlotAllocator
from .spec import CacheSpec


@dataclass
class RequestCache:
    """What one request holds. A live view: read it freely, change it only through the manager."""

    block_table: list[int]
    slot: int
    draft_slots: list[int]
    num_tokens: int  # tokens the block table is sized for
    # Tokens whose KV is valid and whose GDN state `slot` holds (<= num_tokens): what the
    # step outcomes committed. Positions past it hold drafts or nothing.
    num_committed_tokens: int = 0


class HybridCacheManager:
    def __init__(self, spec: CacheSpec, num_blocks: int, num_slots: int, device: str | torch.device = "cpu"):
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"need at least 1 KV block and 1 state slot, got {num_blocks} and {num_slots}")
        self.spec = spec
        self.kv_caches = [
            torch.zeros((num_blocks, *spec.kv_block_shape), dtype=spec.kv_dtype, device=device)
            for _ in range(spec.num_attention_layers)
        ]
        # Row num_slots of every GDN pool is pad_slot, never handed out.
        self.conv_states = [
            torch.zeros((num_slots + 1, *spec.conv_slot_shape), dtype=spec.conv_dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]
        self.recurrent_states = [
            torch.zeros((num_slots + 1, *spec.recurrent_slot_shape), dtype=spec.state_dtype, device=device)
            for _ in range(spec.num_gdn_layers)
        ]
        self._blocks = BlockAllocator(num_blocks)
        self._slots = SlotAllocator(num_slots)
        self._requests: dict[Hashable, RequestCache] = {}

    @classmethod
    def from_budget(
        cls,
        spec: CacheSpec,
        cache_memory_bytes: int,
        max_num_seqs: int,
        draft_slots_per_seq: int = 0,
        device: str | torch.device = "cpu",
    ) -> HybridCacheManager:
        """Split one byte budget: state slots for every sequence first (their number is fixed
        by max_num_seqs and speculation), then as many KV blocks as the rest holds."""
        if max_num_seqs < 1 or draft_slots_per_seq < 0:
            raise ValueError(
                f"need max_num_seqs >= 1 and draft_slots_per_seq >= 0, "
                f"got {max_num_seqs} and {draft_slots_per_seq}"
            )
        num_slots = max_num_seqs * (1 + draft_slots_per_seq)
        slot_bytes = (num_slots + 1) * spec.bytes_per_slot            # + pad_slot
        num_blocks = max(cache_memory_bytes - slot_bytes, 0) // spec.bytes_per_block
        if num_blocks < max_num_seqs:
            needed = slot_bytes + max_num_seqs * spec.bytes_per_block
            raise ValueError(
                f"cache budget of {cache_memory_bytes} bytes is too small: {num_slots} state slots "
                f"({max_num_seqs} seqs x {1 + draft_slots_per_seq}, plus the pad slot) take {slot_bytes} bytes and "
                f"one KV block per seq takes {max_num_seqs * spec.bytes_per_block} more; "
                f"need at least {needed} bytes, or lower max_num_seqs / draft slots"
            )
        return cls(spec, num_blocks, num_slots, device)

    # -- pool sizes ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._blocks.size

    @property
    def num_slots(self) -> int:
        return self._slots.size

    @property
    def pad_slot(self) -> int:
        """A state slot no request owns: padding rows read it (and write nowhere)."""
        return self._slots.size

    @property
    def num_free_blocks(self) -> int:
        return self._blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    # -- admission -----------------------------------------------------------------------

    def can_admit(self, num_tokens: int, num_draft_slots: int = 0) -> bool:
        return (
            self.spec.blocks_for(num_tokens) <= self.num_free_blocks
            and 1 + num_draft_slots <= self.num_free_slots
        )

    def allocate(self, request_id: Hashable, num_tokens: int, num_draft_slots: int = 0) -> RequestCache:
        """Blocks for num_tokens, one committed slot and num_draft_slots draft slots."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds cache memory; free it first")
        if num_tokens < 0 or num_draft_slots < 0:
            raise ValueError(f"cannot allocate {num_tokens} tokens and {num_draft_slots} draft slots")
        if not self.can_admit(num_tokens, num_draft_slots):
            raise CacheCapacityError(
                f"request {request_id!r} needs {self.spec.blocks_for(num_tokens)} KV blocks "
                f"({self.num_free_blocks} free) and {1 + num_draft_slots} state slots "
                f"({self.num_free_slots} free)"
            )
        block_table = self._blocks.allocate(self.spec.blocks_for(num_tokens))
        slot, *draft_slots = self._slots.allocate(1 + num_draft_slots)
        cache = RequestCache(block_table, slot, draft_slots, num_tokens)
        self._requests[request_id] = cache
        return cache

    def has(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def get(self, request_id: Hashable) -> RequestCache:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no cache memory") from None

    # -- KV length -----------------------------------------------------------------------

    def blocks_needed(self, request_id: Hashable, new_num_tokens: int) -> int:
        """Blocks to add so the request can hold new_num_tokens tokens (0 if it already can)."""
        cache = self.get(request_id)
        return max(self.spec.blocks_for(new_num_tokens) - len(cache.block_table), 0)

    def can_grow(self, request_id: Hashable, new_num_tokens: int) -> bool:
        return self.blocks_needed(request_id, new_num_tokens) <= self.num_free_blocks

    def grow(self, request_id: Hashable, new_num_tokens: int) -> None:
        cache = self.get(request_id)
        if new_num_tokens < cache.num_tokens:
            raise ValueError(
                f"request {request_id!r} holds {cache.num_tokens} tokens; grow to "
                f"{new_num_tokens} would shrink it (use truncate)"
            )
        needed = self.blocks_needed(request_id, new_num_tokens)
        if needed > self.num_free_blocks:
            raise CacheCapacityError(
                f"request {request_id!r} needs {needed} more KV blocks to hold {new_num_tokens} "
                f"tokens but only {self.num_free_blocks} of {self.num_blocks} are free"
            )
        cache.block_table.extend(self._blocks.allocate(needed))
        cache.num_tokens = new_num_tokens

    def truncate(self, request_id: Hashable, num_tokens: int) -> None:
        """Shrink what the request holds to num_tokens tokens; frees the tail blocks."""
        cache = self.get(request_id)
        if not 0 <= num_tokens <= cache.num_tokens:
            raise ValueError(
                f"request {request_id!r} holds {cache.num_tokens} tokens; cannot truncate to {num_tokens}"
            )
        keep = self.spec.blocks_for(num_tokens)
        self._blocks.free(cache.block_table[keep:])
        del cache.block_table[keep:]
        cache.num_tokens = num_tokens
        cache.num_committed_tokens = min(cache.num_committed_tokens, num_tokens)

    # -- step outcomes -------------------------------------------------------------------

    def commit(self, request_id: Hashable, num_tokens: int) -> None:
        """A prefill chunk or a plain decode wrote KV and state up to num_tokens tokens."""
        cache = self.get(request_id)
        self._check_commit(request_id, cache, num_tokens)
        cache.num_committed_tokens = num_tokens

    def commit_verify(self, request_id: Hashable, num_tokens: int, accepted: int) -> None:
        """After a verify that accepted `accepted` drafts: the committed length becomes
        num_tokens (C + accepted + 1) and, when a draft was accepted, the draft slot holding
        the state after the last accepted position becomes the committed slot and the old
        committed slot takes its place among the drafts (a swap of ids; no state is copied).
        The blocks past num_tokens stay with the request: the next verify writes there again."""
        cache = self.get(request_id)
        self._check_commit(request_id, cache, num_tokens)
        if not 0 <= accepted <= len(cache.draft_slots):
            raise IndexError(f"request {request_id!r} has {len(cache.draft_slots)} draft slots; "
                             f"cannot accept {accepted} drafts")
        if accepted:
            i = accepted - 1
            cache.slot, cache.draft_slots[i] = cache.draft_slots[i], cache.slot
        cache.num_committed_tokens = num_tokens

    def _check_commit(self, request_id: Hashable, cache: RequestCache, num_tokens: int) -> None:
        if not cache.num_committed_tokens <= num_tokens <= cache.num_tokens:
            raise ValueError(f"request {request_id!r} has {cache.num_committed_tokens} committed tokens and "
                             f"room for {cache.num_tokens}; cannot commit {num_tokens}")

    # -- copies --------------------------------------------------------------------------

    def can_fork(self, src_request_id: Hashable, num_draft_slots: int = 0) -> bool:
        """Whether `fork` from this request would fit now."""
        return self.can_admit(self.get(src_request_id).num_committed_tokens, num_draft_slots)

    def fork(self, src_request_id: Hashable, dst_request_id: Hashable, num_draft_slots: int = 0) -> RequestCache:
        """A new request holding a copy of what src committed: new blocks with the KV of src's
        committed blocks in every attention layer (the MTP layer included), and a new slot with
        src's committed GDN conv window and recurrent state, plus num_draft_slots draft slots.
        dst then continues on its own: nothing is shared, so either may write or free freely."""
        src = self.get(src_request_id)
        if dst_request_id in self._requests:
            raise ValueError(f"request {dst_request_id!r} already holds cache memory; free it first")
        num_tokens = src.num_committed_tokens
        if num_draft_slots < 0:
            raise ValueError(f"cannot fork with {num_draft_slots} draft slots")
        if not self.can_admit(num_tokens, num_draft_slots):
            raise CacheCapacityError(
                f"fork of request {src_request_id!r} needs {self.spec.blocks_for(num_tokens)} KV blocks "
                f"({self.num_free_blocks} free) and {1 + num_draft_slots} state slots ({self.num_free_slots} free)"
            )
        dst = self.allocate(dst_request_id, num_tokens, num_draft_slots)
        if dst.block_table:
            device = self.kv_caches[0].device
            old = torch.tensor(src.block_table[:len(dst.block_table)], device=device)
            new = torch.tensor(dst.block_table, device=device)
            for kv in self.kv_caches:
                kv.index_copy_(0, new, kv.index_select(0, old))
        for pool in (*self.conv_states, *self.recurrent_states):
            pool[dst.slot].copy_(pool[src.slot])
        dst.num_committed_tokens = num_tokens
        return dst

    # -- release -------------------------------------------------------------------------

    def free(self, request_id: Hashable) -> None:
        """Release everything the request held (finished or preempted)."""
        cache = self.get(request_id)
        self._blocks.free(cache.block_table)
        self._slots.free([cache.slot, *cache.draft_slots])
        del self._requests[request_id]

    # -- inspection ----------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        used_blocks = self._blocks.num_used
        used_slots = self._slots.num_used
        return {
            "num_requests": len(self._requests),
            "blocks_total": self.num_blocks,
            "blocks_used": used_blocks,
            "blocks_free": self.num_free_blocks,
            "slots_total": self.num_slots,
            "slots_used": used_slots,
            "slots_free": self.num_free_slots,
            "kv_bytes_total": self.num_blocks * self.spec.bytes_per_block,
            "kv_bytes_used": used_blocks * self.spec.bytes_per_block,
            "state_bytes_total": (self.num_slots + 1) * self.spec.bytes_per_slot,   # + pad_slot
            "state_bytes_used": used_slots * self.spec.bytes_per_slot,
        }
