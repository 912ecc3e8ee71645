"""HybridCacheManager: the one owner of all cache memory and of who holds which part of it.

Two pools, sized once at start-up:
- KV blocks, shared by every full-attention layer (the MTP layer included): a request holds
  a block table long enough for the tokens it has asked for.
- GDN state slots (conv window + recurrent state of every GDN layer): a request holds one
  committed slot, plus draft slots while it speculates, so that verification writes the
  state after each draft position without touching the committed one.

A request is admitted only if both kinds fit. Every verb checks before it changes anything:
a refused call (CacheCapacityError, ValueError, KeyError) leaves the manager as it was.

`fork` gives a new request what another has committed: its prefix-cached blocks shared, a
copy of the rest (the n samples of one prompt share its prefill this way:
hybrid_engine/request_group.py).

Each outcome of a step has one verb: `commit` (a prefill chunk or a plain decode was
written), `commit_verify` (a verify step: the KV length and the committed GDN slot move
together, so no half-done rewind can exist), `free` (finished or preempted). A request's
blocks past its committed length stay with it while it runs: the next step's drafts and
verify reuse them instead of giving them back and taking them again.

One extra slot, `pad_slot`, belongs to no request: the padding rows of a CUDA-graph decode
step (hybrid_engine/cuda_graph_steps.py) read it and write nowhere, so a padded row can never
race a real row for a state. It is part of the pools and of the byte budget.

Prefix caching (state_cache/prefix_blocks.py, state_cache/checkpoints.py): a request's
committed full blocks are registered under their chain hashes (`cache_blocks`) and stay cached
after it frees them, until their memory is needed; GDN checkpoints are written from a
request's slots (`save_checkpoint`). `match_prefix` finds the longest cached prefix with a
checkpoint at its end, and `allocate(..., hit=...)` starts a request there: it shares the
hit's blocks (counted once by admission), copies the checkpoint into its own slot and starts
with the hit's tokens committed. A shared block is never written: a request writes only at
positions past its committed length, and with `copy_last_hit_block` (MTP, whose KV entry at
the hit's last position depends on the token after it) a hit's last block is copied, not shared.

Slot contents are NOT zeroed on allocate: a new slot holds whatever its last owner left.
The model must treat a request's first prefill chunk as having no initial state (the
per-request has_initial_state flag) and overwrite the slot, never read it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .checkpoints import Checkpoint, CheckpointPool
from .errors import CacheCapacityError
from .prefix_blocks import PrefixBlockPool
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
    # The first blocks of block_table that are registered in the prefix cache (or were found
    # there): never written again, never truncated away.
    num_cached_blocks: int = 0
    # After a prefix hit with MTP: the target's hidden state at the hit's last position, for the
    # MTP layer's one KV entry there (taken once by take_hit_hidden).
    hit_hidden: torch.Tensor | None = None

    # The write-slot order, in one place: a step of n tokens from the committed state writes the
    # state after its token j to write slot j: the committed slot for j = 0 (plain decode writes
    # back where it read), draft slot j - 1 after it. commit_verify then swaps the slot after the
    # last accepted token in as the committed one.

    def write_slot(self, j: int) -> int:
        """Where the GDN state after token j of a step (from the committed state) goes."""
        return self.slot if j == 0 else self.draft_slots[j - 1]

    def write_slots(self, n: int) -> list[int]:
        """write_slot(j) for the n tokens of a step, in order."""
        return [self.slot, *self.draft_slots[:n - 1]]


@dataclass
class PrefixHit:
    """A cached prefix a request can start from: num_tokens tokens (a whole number of blocks)
    whose KV is in `blocks` and whose GDN state is in `checkpoint`."""

    num_tokens: int
    blocks: list[int]
    checkpoint: Checkpoint


class HybridCacheManager:
    def __init__(self, spec: CacheSpec, num_blocks: int, num_slots: int, device: str | torch.device = "cpu",
                 num_checkpoints: int = 0, copy_last_hit_block: bool = False):
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"need at least 1 KV block and 1 state slot, got {num_blocks} and {num_slots}")
        self.spec = spec
        self.kv_caches = [
            torch.zeros((num_blocks, *spec.kv_block_shape), dtype=spec.kv_dtype, device=device)
            for _ in range(spec.num_attention_layers)
        ]
        # Row num_slots of every GDN pool is pad_slot, never handed out. Each kind's pools are
        # the layers of one tensor [layers, slots, ...] (each layer's a contiguous view): a
        # slot's state in every layer (a checkpoint saved or loaded, a fork) is one copy, not
        # one per layer and kind (a decode that crosses a block boundary saves one).
        self.conv_layers = torch.zeros((spec.num_gdn_layers, num_slots + 1, *spec.conv_slot_shape),
                                       dtype=spec.conv_dtype, device=device)
        self.recurrent_layers = torch.zeros((spec.num_gdn_layers, num_slots + 1, *spec.recurrent_slot_shape),
                                            dtype=spec.state_dtype, device=device)
        self.conv_states = list(self.conv_layers.unbind(0))
        self.recurrent_states = list(self.recurrent_layers.unbind(0))
        self._blocks = PrefixBlockPool(num_blocks)
        self.checkpoints = CheckpointPool(spec, num_checkpoints, device)
        self.copy_last_hit_block = copy_last_hit_block
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
        num_checkpoints: int = 0,
        copy_last_hit_block: bool = False,
    ) -> HybridCacheManager:
        """Split one byte budget: the requests' needs first (state slots for every sequence,
        their number fixed by max_num_seqs and speculation, and at least one KV block each),
        then up to num_checkpoints prefix checkpoints from what is left (`checkpoints_that_fit`:
        fewer, down to none, when the budget is short; the caller says so), then as many KV
        blocks as the rest holds."""
        if max_num_seqs < 1 or draft_slots_per_seq < 0:
            raise ValueError(
                f"need max_num_seqs >= 1 and draft_slots_per_seq >= 0, "
                f"got {max_num_seqs} and {draft_slots_per_seq}"
            )
        num_slots = max_num_seqs * (1 + draft_slots_per_seq)
        slot_bytes = (num_slots + 1) * spec.bytes_per_slot            # + pad_slot
        left = cache_memory_bytes - slot_bytes
        if left < max_num_seqs * spec.bytes_per_block:
            raise ValueError(
                f"cache budget of {cache_memory_bytes} bytes is too small: {num_slots} state slots "
                f"({max_num_seqs} seqs x {1 + draft_slots_per_seq}, plus the pad slot) take {slot_bytes} bytes "
                f"and one KV block per seq takes {max_num_seqs * spec.bytes_per_block} more; "
                f"need at least {slot_bytes + max_num_seqs * spec.bytes_per_block} bytes, "
                f"or lower max_num_seqs / draft slots"
            )
        num_checkpoints = cls.checkpoints_that_fit(spec, left, max_num_seqs, num_checkpoints)
        num_blocks = (left - num_checkpoints * CheckpointPool.bytes_per_checkpoint(spec)) // spec.bytes_per_block
        return cls(spec, num_blocks, num_slots, device, num_checkpoints, copy_last_hit_block)

    @staticmethod
    def checkpoints_that_fit(spec: CacheSpec, num_bytes: int, min_blocks: int, wanted: int) -> int:
        """How many of `wanted` prefix checkpoints num_bytes holds beside at least min_blocks KV
        blocks and at least as many KV blocks as checkpoints: a checkpoint is found by the hash
        of the cached block ending where it was taken, so more checkpoints than blocks could
        never all be hit."""
        per_checkpoint = CheckpointPool.bytes_per_checkpoint(spec)
        fit = num_bytes // (per_checkpoint + spec.bytes_per_block)                  # a block each
        if per_checkpoint:                      # (a spec without GDN layers keeps empty checkpoints)
            fit = min(fit, (num_bytes - min_blocks * spec.bytes_per_block) // per_checkpoint)
        return max(0, min(wanted, fit))

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
        """Blocks a request can get: free ones and cached ones nobody holds (evicted on use)."""
        return self._blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

    # -- admission -----------------------------------------------------------------------

    def match_prefix(self, block_hashes: list[bytes], max_tokens: int) -> PrefixHit | None:
        """The longest cached prefix of at most max_tokens tokens: every block of it cached (in
        order, by chain hash) and a checkpoint at its end. Changes nothing."""
        blocks = self._cached_chain(block_hashes[:max(max_tokens, 0) // self.spec.block_size])
        for n in range(len(blocks), 0, -1):
            checkpoint = self.checkpoints.find(block_hashes[n - 1])
            if checkpoint is not None:
                return PrefixHit(n * self.spec.block_size, blocks[:n], checkpoint)
        return None

    def _cached_chain(self, block_hashes: list[bytes]) -> list[int]:
        blocks = []
        for h in block_hashes:
            block = self._blocks.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_cached_prefix_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of this chain are cached, checkpoint or not."""
        return len(self._cached_chain(block_hashes))

    def has_checkpoint(self, key: bytes) -> bool:
        return self.checkpoints.find(key) is not None

    def _blocks_to_take(self, num_tokens: int, hit: PrefixHit | None) -> int:
        """Free-count blocks an admission uses: new ones, plus hit blocks nobody holds now (they
        leave the free count while shared). Shared blocks are counted once, whoever holds them."""
        new = self.spec.blocks_for(num_tokens)
        if hit is None:
            return new
        new -= len(hit.blocks) - self.copy_last_hit_block
        return new + self._blocks.num_idle_among(hit.blocks)

    def can_admit(self, num_tokens: int, num_draft_slots: int = 0, hit: PrefixHit | None = None) -> bool:
        return (
            self._blocks_to_take(num_tokens, hit) <= self.num_free_blocks
            and 1 + num_draft_slots <= self.num_free_slots
        )

    def allocate(self, request_id: Hashable, num_tokens: int, num_draft_slots: int = 0,
                 hit: PrefixHit | None = None) -> RequestCache:
        """Blocks for num_tokens, one committed slot and num_draft_slots draft slots. With a
        hit (from match_prefix, with nothing changed since), the request starts with the hit's
        tokens committed: it shares the hit's blocks and its slot holds the checkpoint's state."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds cache memory; free it first")
        if num_tokens < 0 or num_draft_slots < 0:
            raise ValueError(f"cannot allocate {num_tokens} tokens and {num_draft_slots} draft slots")
        if hit is not None:
            self._check_hit(hit, num_tokens)
        if not self.can_admit(num_tokens, num_draft_slots, hit):
            raise CacheCapacityError(
                f"request {request_id!r} needs {self._blocks_to_take(num_tokens, hit)} KV blocks "
                f"({self.num_free_blocks} free) and {1 + num_draft_slots} state slots "
                f"({self.num_free_slots} free)"
            )
        if hit is None:
            block_table = self._blocks.allocate(self.spec.blocks_for(num_tokens))
        else:
            # Take the hit's blocks before allocating: allocation may evict idle cached blocks.
            self._blocks.take(hit.blocks)
            block_table = list(hit.blocks)
            block_table += self._blocks.allocate(self.spec.blocks_for(num_tokens) - len(hit.blocks))
            if self.copy_last_hit_block:
                shared = hit.blocks[-1]
                own = self._blocks.allocate(1)[0]
                for kv in self.kv_caches:
                    kv[own].copy_(kv[shared])
                block_table[len(hit.blocks) - 1] = own
                self._blocks.free([shared])
        slot, *draft_slots = self._slots.allocate(1 + num_draft_slots)
        cache = RequestCache(block_table, slot, draft_slots, num_tokens)
        if hit is not None:
            self._load_checkpoint(hit.checkpoint, slot)
            cache.num_committed_tokens = hit.num_tokens
            cache.num_cached_blocks = len(hit.blocks)     # the copied last one duplicates a cached one
            if self.spec.hidden_size:
                cache.hit_hidden = self.checkpoints.hidden[hit.checkpoint.entry].clone()
        self._requests[request_id] = cache
        return cache

    def _check_hit(self, hit: PrefixHit, num_tokens: int) -> None:
        if not 0 < hit.num_tokens < num_tokens or len(hit.blocks) * self.spec.block_size != hit.num_tokens:
            raise ValueError(f"a prefix hit of {hit.num_tokens} tokens in {len(hit.blocks)} blocks cannot start "
                             f"a request of {num_tokens} tokens")
        if self.checkpoints.find(hit.checkpoint.key) is not hit.checkpoint or any(
                self._blocks.hash_of(b) is None for b in hit.blocks):
            raise ValueError("the prefix hit is stale: its blocks or checkpoint were evicted since match_prefix")

    def _load_checkpoint(self, checkpoint: Checkpoint, slot: int) -> None:
        pool = self.checkpoints
        self.conv_layers.select(1, slot).copy_(pool.conv_layers.select(1, checkpoint.entry))
        self.recurrent_layers.select(1, slot).copy_(pool.recurrent_layers.select(1, checkpoint.entry))
        pool.touch(checkpoint.key)

    def take_hit_hidden(self, request_id: Hashable) -> torch.Tensor | None:
        """The hidden state a prefix hit brought (once; None after, or without a hit)."""
        cache = self.get(request_id)
        hidden, cache.hit_hidden = cache.hit_hidden, None
        return hidden

    @property
    def checkpoint_conv_states(self) -> list[torch.Tensor]:
        return self.checkpoints.conv

    @property
    def checkpoint_recurrent_states(self) -> list[torch.Tensor]:
        return self.checkpoints.recurrent

    def has(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def get(self, request_id: Hashable) -> RequestCache:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no cache memory") from None

    # -- KV length -----------------------------------------------------------------------

    def try_grow(self, request_id: Hashable, new_num_tokens: int) -> bool:
        """Room for new_num_tokens tokens (never fewer than it holds) where the blocks that needs
        are free; False, changing nothing, where not (the scheduler's check and growth in one
        call: a decode grows every step, and needs a new block once per block_size steps)."""
        cache = self.get(request_id)
        if new_num_tokens < cache.num_tokens:
            raise ValueError(
                f"request {request_id!r} holds {cache.num_tokens} tokens; grow to "
                f"{new_num_tokens} would shrink it"
            )
        needed = self.spec.blocks_for(new_num_tokens) - len(cache.block_table)
        if needed > 0:
            if needed > self.num_free_blocks:
                return False
            cache.block_table.extend(self._blocks.allocate(needed))
        cache.num_tokens = new_num_tokens
        return True

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
        if accepted:                       # write slot `accepted` holds the state after the last one
            i = accepted - 1
            cache.slot, cache.draft_slots[i] = cache.write_slot(accepted), cache.slot
        cache.num_committed_tokens = num_tokens

    def _check_commit(self, request_id: Hashable, cache: RequestCache, num_tokens: int) -> None:
        if not cache.num_committed_tokens <= num_tokens <= cache.num_tokens:
            raise ValueError(f"request {request_id!r} has {cache.num_committed_tokens} committed tokens and "
                             f"room for {cache.num_tokens}; cannot commit {num_tokens}")

    # -- prefix cache --------------------------------------------------------------------

    def cache_blocks(self, request_id: Hashable, block_hashes: list[bytes]) -> None:
        """Registers the request's committed full blocks under their chain hashes
        (block_hashes[i] names block i), so later requests can share them."""
        cache = self.get(request_id)
        full = min(cache.num_committed_tokens // self.spec.block_size, len(block_hashes))
        for i in range(cache.num_cached_blocks, full):
            self._blocks.register(cache.block_table[i], block_hashes[i])
        cache.num_cached_blocks = max(cache.num_cached_blocks, full)

    def save_checkpoint(self, request_id: Hashable, num_tokens: int, key: bytes, source_slot: int,
                        hidden: torch.Tensor | None = None, pending: bool = False) -> bool:
        """Copies the GDN state in one of the request's slots, which the caller knows to hold the
        state after exactly num_tokens accepted tokens (never a rejected draft position), into a
        checkpoint named `key` (the chain hash of the block ending at num_tokens); `hidden`: the
        target's hidden state at num_tokens - 1. pending: the request's own checkpoint, replaced
        by its next one and published when it frees. False when none was taken (already
        published under `key`, or every checkpoint is pending)."""
        cache = self.get(request_id)
        if source_slot not in (cache.slot, *cache.draft_slots):
            raise ValueError(f"slot {source_slot} is not one of request {request_id!r}'s slots")
        if num_tokens % self.spec.block_size or not 0 < num_tokens <= cache.num_tokens:
            raise ValueError(f"request {request_id!r} holds {cache.num_tokens} tokens; a checkpoint at "
                             f"{num_tokens} must be within them and at a block boundary")
        checkpoint = self.checkpoints.entry_for(key, num_tokens, request_id if pending else None)
        if checkpoint is None:
            return False
        pool, entry = self.checkpoints, checkpoint.entry
        pool.conv_layers.select(1, entry).copy_(self.conv_layers.select(1, source_slot))
        pool.recurrent_layers.select(1, entry).copy_(self.recurrent_layers.select(1, source_slot))
        if hidden is not None and self.spec.hidden_size:
            pool.hidden[entry].copy_(hidden)
        return True

    def reserve_checkpoint(self, key: bytes, num_tokens: int) -> int | None:
        """A published checkpoint entry named `key` for a state after num_tokens tokens, which
        the caller's next forward writes (ForwardBatch.gdn_captures; its hidden state through
        `write_checkpoint_hidden`). None when one is already published under `key` or every
        entry is pending. The caller must not match prefixes before that forward."""
        if num_tokens % self.spec.block_size or num_tokens <= 0:
            raise ValueError(f"a checkpoint at {num_tokens} tokens is not at a block boundary")
        checkpoint = self.checkpoints.entry_for(key, num_tokens, None)
        return None if checkpoint is None else checkpoint.entry

    def discard_checkpoints(self, entries: list[int]) -> None:
        """Reserved entries whose forward failed: unpublished, their memory free again."""
        for entry in entries:
            self.checkpoints.discard(entry)

    def write_checkpoint_hidden(self, entry: int, hidden: torch.Tensor) -> None:
        """The target's hidden state at the last position of a reserved checkpoint (kept only
        for the MTP layer)."""
        if self.spec.hidden_size:
            self.checkpoints.hidden[entry].copy_(hidden)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached prefix nobody holds: idle cached blocks and published
        checkpoints (vLLM's reset_prefix_cache). Blocks running requests hold stay theirs and
        cached, so what they share stays read-only."""
        self._blocks.drop_idle()
        self.checkpoints.drop_published()

    # -- copies --------------------------------------------------------------------------

    def can_fork(self, src_request_id: Hashable, num_draft_slots: int = 0, num_tokens: int | None = None) -> bool:
        """Whether `fork` from this request would fit now, and (num_tokens) whether the copy
        could then hold num_tokens tokens."""
        src = self.get(src_request_id)
        need = self.spec.blocks_for(max(num_tokens or 0, src.num_committed_tokens)) - len(self._shared_by_fork(src))
        return need <= self.num_free_blocks and 1 + num_draft_slots <= self.num_free_slots

    def _shared_by_fork(self, src: RequestCache) -> list[int]:
        """src's first blocks a fork shares instead of copying: the leading run of those in the
        prefix cache (committed, full, never written again). The blocks after are copied."""
        shared = []
        for b in src.block_table[:src.num_cached_blocks]:
            if self._blocks.hash_of(b) is None:       # its holder's own copy (MTP's hit block, a duplicate)
                break
            shared.append(b)
        return shared

    def fork(self, src_request_id: Hashable, dst_request_id: Hashable, num_draft_slots: int = 0) -> RequestCache:
        """A new request holding what src committed: src's cached blocks shared (read-only, by
        reference, as a prefix hit shares them), a copy of its other committed blocks in every
        attention layer (the MTP layer included), and a new slot with src's committed GDN conv
        window and recurrent state, plus num_draft_slots draft slots. dst then continues on its
        own: what it may write is its own, so either may write or free freely."""
        src = self.get(src_request_id)
        if dst_request_id in self._requests:
            raise ValueError(f"request {dst_request_id!r} already holds cache memory; free it first")
        num_tokens = src.num_committed_tokens
        if num_draft_slots < 0:
            raise ValueError(f"cannot fork with {num_draft_slots} draft slots")
        if not self.can_fork(src_request_id, num_draft_slots):
            raise CacheCapacityError(
                f"fork of request {src_request_id!r} needs {self.spec.blocks_for(num_tokens)} KV blocks "
                f"({len(self._shared_by_fork(src))} shared, {self.num_free_blocks} free) and "
                f"{1 + num_draft_slots} state slots ({self.num_free_slots} free)"
            )
        shared = self._shared_by_fork(src)
        self._blocks.take(shared)
        copied = self._blocks.allocate(self.spec.blocks_for(num_tokens) - len(shared))
        if copied:
            device = self.kv_caches[0].device
            old = torch.tensor(src.block_table[len(shared):len(shared) + len(copied)], device=device)
            new = torch.tensor(copied, device=device)
            for kv in self.kv_caches:
                kv.index_copy_(0, new, kv.index_select(0, old))
        slot, *draft_slots = self._slots.allocate(1 + num_draft_slots)
        for layers in (self.conv_layers, self.recurrent_layers):
            layers.select(1, slot).copy_(layers.select(1, src.slot))
        dst = RequestCache(shared + copied, slot, draft_slots, num_tokens, num_committed_tokens=num_tokens,
                           num_cached_blocks=len(shared))
        self._requests[dst_request_id] = dst
        return dst

    # -- release -------------------------------------------------------------------------

    def free(self, request_id: Hashable) -> None:
        """Release everything the request held (finished or preempted). Its cached blocks stay
        cached and its pending checkpoint is published, for the next turn or its readmission."""
        cache = self.get(request_id)
        self.checkpoints.release(request_id)
        self._blocks.free(reversed(cache.block_table))     # deepest block first in the LRU
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
            "blocks_cached": self._blocks.num_cached,
            "blocks_cached_idle": self._blocks.num_idle,
            "checkpoints_total": self.checkpoints.size,
            "checkpoints_published": len(self.checkpoints.published()),
            "checkpoints_pending": self.checkpoints.num_pending,
            "checkpoint_bytes_total": self.checkpoints.size * CheckpointPool.bytes_per_checkpoint(self.spec),
        }

    def block_ref_count(self, block: int) -> int:
        return self._blocks.ref_count(block)

    def cached_block_hash(self, block: int) -> bytes | None:
        return self._blocks.hash_of(block)
