"""HybridCacheManager: the one owner of all cache memory and of who holds which part of it.

Two pools, sized once at start-up (their memory: `pools`, state_cache/pools.py):
- KV blocks, shared by every full-attention layer (the MTP layer included): a request holds
  a block table long enough for the tokens it has asked for.
- GDN state slots (conv window + recurrent state of every GDN layer): a request holds one
  committed slot, plus draft slots while it speculates, so that verification writes the
  state after each draft position without touching the committed one.

A request's life is five verbs, each checking before it changes anything (a refused call
leaves the manager as it was): `allocate` (admitted only if both kinds fit, else None),
`fork` (a new request with what another committed: its prefix-cached blocks shared, a copy of
the rest; the n samples of one prompt share its prefill this way: hybrid_engine/request_group.py),
`grow` (more KV, False where it does not fit), `commit` (what a step made valid: a prefill
chunk, a decode, or a verify, whose KV length and committed GDN slot move together so that no
half-done rewind can exist) and `free` (finished or preempted). A request's blocks past its
committed length stay with it while it runs: the next step's drafts and verify reuse them
instead of giving them back and taking them again.

Prefix caching (`prefix_store`, state_cache/prefix_store.py): committed full blocks are
registered under their chain hashes and GDN checkpoints are taken at block boundaries;
`prefix_store.match` finds a hit and `allocate(..., hit=...)` starts a request there: it shares
the hit's blocks (counted once by admission), copies the checkpoint into its own slot and
starts with the hit's tokens committed. A shared block is never written: a request writes only
at positions past its committed length, and with copy_last_hit_block (MTP, whose KV entry at
the hit's last position depends on the token after it) a hit's last block is copied, not shared.

Slot contents are NOT zeroed on allocate: a new slot holds whatever its last owner left.
The model must treat a request's first prefill chunk as having no initial state (the
per-request has_initial_state flag) and overwrite the slot, never read it.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .checkpoints import CheckpointPool
from .id_pool import IdPool
from .pools import CachePools
from .prefix_blocks import PrefixBlockPool
from .prefix_store import PrefixHit, PrefixStore
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
    # MTP layer's one KV entry there (taken once by prefix_store.take_hit_hidden).
    hit_hidden: torch.Tensor | None = None

    # The write-slot order, in one place: a step of n tokens from the committed state writes the
    # state after its token j to write slot j: the committed slot for j = 0 (plain decode writes
    # back where it read), draft slot j - 1 after it. A commit after a verify then swaps the slot after the
    # last accepted token in as the committed one.

    def write_slot(self, j: int) -> int:
        """Where the GDN state after token j of a step (from the committed state) goes."""
        return self.slot if j == 0 else self.draft_slots[j - 1]

    def write_slots(self, n: int) -> list[int]:
        """write_slot(j) for the n tokens of a step, in order."""
        return [self.slot, *self.draft_slots[:n - 1]]


class HybridCacheManager:
    """The cache's contract; every verb checks before it changes anything (a refused call,
    None / False or an error, changes nothing):

        allocate(request_id, num_tokens, num_draft_slots=0, hit=None) -> RequestCache | None
        fork(src_id, dst_id, num_draft_slots=0, room_for=None)        -> RequestCache | None
        grow(request_id, num_tokens)                                 -> bool
        commit(request_id, num_tokens, accepted=0)
        free(request_id)
        get(request_id) -> RequestCache;  request_id in cache

    Beside them: `pools` (all cache memory: what a forward reads), `prefix_store` (block hashes
    and GDN checkpoints), `spec`, the sizes and `usage()` (read-only), and `from_budget`."""

    def __init__(self, spec: CacheSpec, num_blocks: int, num_slots: int, device: str | torch.device = "cpu",
                 num_checkpoints: int = 0, copy_last_hit_block: bool = False):
        if num_blocks < 1 or num_slots < 1:
            raise ValueError(f"need at least 1 KV block and 1 state slot, got {num_blocks} and {num_slots}")
        self.spec = spec
        self.pools = CachePools(spec, num_blocks, num_slots, num_checkpoints, device)
        self._blocks = PrefixBlockPool(num_blocks)
        self._slots = IdPool(num_slots, "state slot")
        self._checkpoints = CheckpointPool(num_checkpoints)
        self._copy_last_hit_block = copy_last_hit_block
        self._requests: dict[Hashable, RequestCache] = {}
        self.prefix_store = PrefixStore(spec, self._blocks, self._checkpoints, self.pools, self.get)

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
        then up to num_checkpoints prefix checkpoints from what is left (`_checkpoints_that_fit`:
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
        num_checkpoints = _checkpoints_that_fit(spec, left, max_num_seqs, num_checkpoints)
        num_blocks = (left - num_checkpoints * CheckpointPool.bytes_per_checkpoint(spec)) // spec.bytes_per_block
        return cls(spec, num_blocks, num_slots, device, num_checkpoints, copy_last_hit_block)

    # -- admission -----------------------------------------------------------------------

    def allocate(self, request_id: Hashable, num_tokens: int, num_draft_slots: int = 0,
                 hit: PrefixHit | None = None) -> RequestCache | None:
        """Blocks for num_tokens, one committed slot and num_draft_slots draft slots; None
        (nothing changed) where the blocks or slots are not free. With a hit (from
        prefix_store.match, with nothing changed since), the request starts with the hit's
        tokens committed: it shares the hit's blocks and its slot holds the checkpoint's state."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already holds cache memory; free it first")
        if num_tokens < 0 or num_draft_slots < 0:
            raise ValueError(f"cannot allocate {num_tokens} tokens and {num_draft_slots} draft slots")
        if hit is not None:
            self._check_hit(hit, num_tokens)
        if (self._blocks_to_take(num_tokens, hit) > self._blocks.num_free
                or 1 + num_draft_slots > self._slots.num_free):
            return None
        if hit is None:
            block_table = self._blocks.allocate(self.spec.blocks_for(num_tokens))
        else:
            # Take the hit's blocks before allocating: allocation may evict idle cached blocks.
            self._blocks.take(hit.blocks)
            block_table = list(hit.blocks)
            block_table += self._blocks.allocate(self.spec.blocks_for(num_tokens) - len(hit.blocks))
            if self._copy_last_hit_block:
                shared = hit.blocks[-1]
                own = self._blocks.allocate(1)[0]
                self.pools.copy_blocks([shared], [own])
                block_table[len(hit.blocks) - 1] = own
                self._blocks.free([shared])
        slot, *draft_slots = self._slots.allocate(1 + num_draft_slots)
        cache = RequestCache(block_table, slot, draft_slots, num_tokens)
        if hit is not None:
            self.pools.load_checkpoint(hit.checkpoint.entry, slot)
            self._checkpoints.touch(hit.checkpoint.key)
            cache.num_committed_tokens = hit.num_tokens
            cache.num_cached_blocks = len(hit.blocks)     # the copied last one duplicates a cached one
            if self.spec.hidden_size:
                cache.hit_hidden = self.pools.checkpoint_hidden[hit.checkpoint.entry].clone()
        self._requests[request_id] = cache
        return cache

    def _blocks_to_take(self, num_tokens: int, hit: PrefixHit | None) -> int:
        """Free-count blocks an admission uses: new ones, plus hit blocks nobody holds now (they
        leave the free count while shared). Shared blocks are counted once, whoever holds them."""
        new = self.spec.blocks_for(num_tokens)
        if hit is None:
            return new
        new -= len(hit.blocks) - self._copy_last_hit_block
        return new + self._blocks.num_idle_among(hit.blocks)

    def _check_hit(self, hit: PrefixHit, num_tokens: int) -> None:
        if not 0 < hit.num_tokens < num_tokens or len(hit.blocks) * self.spec.block_size != hit.num_tokens:
            raise ValueError(f"a prefix hit of {hit.num_tokens} tokens in {len(hit.blocks)} blocks cannot start "
                             f"a request of {num_tokens} tokens")
        if self._checkpoints.find(hit.checkpoint.key) is not hit.checkpoint or any(
                self._blocks.hash_of(b) is None for b in hit.blocks):
            raise ValueError("the prefix hit is stale: its blocks or checkpoint were evicted since it was matched")

    def fork(self, src_request_id: Hashable, dst_request_id: Hashable, num_draft_slots: int = 0,
             room_for: int | None = None) -> RequestCache | None:
        """A new request holding what src committed: src's cached blocks shared (read-only, by
        reference, as a prefix hit shares them), a copy of its other committed blocks in every
        attention layer (the MTP layer included), and a new slot with src's committed GDN conv
        window and recurrent state, plus num_draft_slots draft slots. dst then continues on its
        own: what it may write is its own, so either may write or free freely. None (nothing
        changed) where that does not fit now, or (room_for) where the copy could not then grow
        to room_for tokens."""
        src = self.get(src_request_id)
        if dst_request_id in self._requests:
            raise ValueError(f"request {dst_request_id!r} already holds cache memory; free it first")
        if num_draft_slots < 0:
            raise ValueError(f"cannot fork with {num_draft_slots} draft slots")
        num_tokens = src.num_committed_tokens
        shared = self._shared_by_fork(src)
        if (self.spec.blocks_for(max(room_for or 0, num_tokens)) - len(shared) > self._blocks.num_free
                or 1 + num_draft_slots > self._slots.num_free):
            return None
        self._blocks.take(shared)
        copied = self._blocks.allocate(self.spec.blocks_for(num_tokens) - len(shared))
        if copied:
            self.pools.copy_blocks(src.block_table[len(shared):len(shared) + len(copied)], copied)
        slot, *draft_slots = self._slots.allocate(1 + num_draft_slots)
        self.pools.copy_slot(src.slot, slot)
        dst = RequestCache(shared + copied, slot, draft_slots, num_tokens, num_committed_tokens=num_tokens,
                           num_cached_blocks=len(shared))
        self._requests[dst_request_id] = dst
        return dst

    def _shared_by_fork(self, src: RequestCache) -> list[int]:
        """src's first blocks a fork shares instead of copying: the leading run of those in the
        prefix cache (committed, full, never written again). The blocks after are copied."""
        shared = []
        for b in src.block_table[:src.num_cached_blocks]:
            if self._blocks.hash_of(b) is None:       # its holder's own copy (MTP's hit block, a duplicate)
                break
            shared.append(b)
        return shared

    # -- a running request ---------------------------------------------------------------

    def get(self, request_id: Hashable) -> RequestCache:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"request {request_id!r} holds no cache memory") from None

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._requests

    def grow(self, request_id: Hashable, new_num_tokens: int) -> bool:
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
            if needed > self._blocks.num_free:
                return False
            cache.block_table.extend(self._blocks.allocate(needed))
        cache.num_tokens = new_num_tokens
        return True

    def commit(self, request_id: Hashable, num_tokens: int, accepted: int = 0) -> None:
        """What a step made valid: KV and GDN state up to num_tokens tokens (a prefill chunk, a
        decode, or a verify: C + accepted + 1). After a verify that accepted drafts, the draft
        slot holding the state after the last accepted position becomes the committed slot and
        the old committed slot takes its place among the drafts (a swap of ids; no state is
        copied). The blocks past num_tokens stay with the request: the next verify writes there
        again."""
        cache = self.get(request_id)
        if not cache.num_committed_tokens <= num_tokens <= cache.num_tokens:
            raise ValueError(f"request {request_id!r} has {cache.num_committed_tokens} committed tokens and "
                             f"room for {cache.num_tokens}; cannot commit {num_tokens}")
        if accepted:                       # write slot `accepted` holds the state after the last one
            if not 0 < accepted <= len(cache.draft_slots):
                raise IndexError(f"request {request_id!r} has {len(cache.draft_slots)} draft slots; "
                                 f"cannot accept {accepted} drafts")
            i = accepted - 1
            cache.slot, cache.draft_slots[i] = cache.draft_slots[i], cache.slot
        cache.num_committed_tokens = num_tokens

    def free(self, request_id: Hashable) -> None:
        """Release everything the request held (finished or preempted). Its cached blocks stay
        cached and its pending checkpoint is published, for the next turn or its readmission."""
        cache = self.get(request_id)
        self._checkpoints.release(request_id)
        self._blocks.free(reversed(cache.block_table))     # deepest block first in the LRU
        self._slots.free([cache.slot, *cache.draft_slots])
        del self._requests[request_id]

    # -- inspection ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._blocks.size

    @property
    def num_slots(self) -> int:
        return self._slots.size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can get: free ones and cached ones nobody holds (evicted on use)."""
        return self._blocks.num_free

    @property
    def num_free_slots(self) -> int:
        return self._slots.num_free

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
            "checkpoints_total": self._checkpoints.size,
            "checkpoints_published": len(self._checkpoints.published()),
            "checkpoints_pending": self._checkpoints.num_pending,
            "checkpoint_bytes_total": self._checkpoints.size * CheckpointPool.bytes_per_checkpoint(self.spec),
        }


def _checkpoints_that_fit(spec: CacheSpec, num_bytes: int, min_blocks: int, wanted: int) -> int:
    """How many of `wanted` prefix checkpoints num_bytes holds beside at least min_blocks KV
    blocks and at least as many KV blocks as checkpoints: a checkpoint is found by the hash
    of the cached block ending where it was taken, so more checkpoints than blocks could
    never all be hit."""
    per_checkpoint = CheckpointPool.bytes_per_checkpoint(spec)
    fit = num_bytes // (per_checkpoint + spec.bytes_per_block)                  # a block each
    if per_checkpoint:                      # (a spec without GDN layers keeps empty checkpoints)
        fit = min(fit, (num_bytes - min_blocks * spec.bytes_per_block) // per_checkpoint)
    return max(0, min(wanted, fit))
