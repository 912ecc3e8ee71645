"""PrefixStore: the prefix cache's verbs (the manager owns it: `HybridCacheManager.prefix_store`).

What it keeps: a request's committed full KV blocks registered under their chain hashes
(`cache_blocks`; state_cache/prefix_blocks.py), which stay cached after the request frees them
until their memory is needed, and GDN checkpoints at block boundaries (state_cache/checkpoints.py),
either copied from a request's slots (`save_checkpoint`) or written by a prefill's own forward
into an entry reserved for it (`reserve_checkpoint`, then `write_hidden`; `discard` when that
forward failed). `match` finds the longest cached prefix with a checkpoint at its end; the
manager's `allocate(..., hit=...)` starts a request there.

Lookups change nothing; every verb checks before it changes anything (ValueError, KeyError).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .checkpoints import Checkpoint, CheckpointPool
from .pools import CachePools
from .prefix_blocks import PrefixBlockPool
from .spec import CacheSpec

if TYPE_CHECKING:
    from .hybrid_cache import RequestCache


@dataclass
class PrefixHit:
    """A cached prefix a request can start from: num_tokens tokens (a whole number of blocks)
    whose KV is in `blocks` and whose GDN state is in `checkpoint`."""

    num_tokens: int
    blocks: list[int]
    checkpoint: Checkpoint


class PrefixStore:
    def __init__(self, spec: CacheSpec, blocks: PrefixBlockPool, checkpoints: CheckpointPool, pools: CachePools,
                 get: Callable[[Hashable], RequestCache]):
        self._spec = spec
        self._blocks = blocks                # the manager's KV block pool: the hashes live on its blocks
        self.checkpoints = checkpoints       # read it freely (size, published()); change it only here
        self._pools = pools
        self._get = get                      # the manager's get: what a request holds

    # -- lookups ----------------------------------------------------------------------------

    def match(self, block_hashes: list[bytes], max_tokens: int) -> PrefixHit | None:
        """The longest cached prefix of at most max_tokens tokens: every block of it cached (in
        order, by chain hash) and a checkpoint at its end."""
        blocks = self._cached_chain(block_hashes[:max(max_tokens, 0) // self._spec.block_size])
        for n in range(len(blocks), 0, -1):
            checkpoint = self.checkpoints.find(block_hashes[n - 1])
            if checkpoint is not None:
                return PrefixHit(n * self._spec.block_size, blocks[:n], checkpoint)
        return None

    def num_cached_blocks(self, block_hashes: list[bytes]) -> int:
        """How many leading blocks of this chain are cached, checkpoint or not."""
        return len(self._cached_chain(block_hashes))

    def has_checkpoint(self, key: bytes) -> bool:
        return self.checkpoints.find(key) is not None

    def _cached_chain(self, block_hashes: list[bytes]) -> list[int]:
        blocks = []
        for h in block_hashes:
            block = self._blocks.lookup(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    # -- verbs ------------------------------------------------------------------------------

    def cache_blocks(self, request_id: Hashable, block_hashes: list[bytes]) -> None:
        """Registers the request's committed full blocks under their chain hashes
        (block_hashes[i] names block i), so later requests can share them."""
        cache = self._get(request_id)
        full = min(cache.num_committed_tokens // self._spec.block_size, len(block_hashes))
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
        cache = self._get(request_id)
        if source_slot not in (cache.slot, *cache.draft_slots):
            raise ValueError(f"slot {source_slot} is not one of request {request_id!r}'s slots")
        if num_tokens % self._spec.block_size or not 0 < num_tokens <= cache.num_tokens:
            raise ValueError(f"request {request_id!r} holds {cache.num_tokens} tokens; a checkpoint at "
                             f"{num_tokens} must be within them and at a block boundary")
        checkpoint = self.checkpoints.entry_for(key, num_tokens, request_id if pending else None)
        if checkpoint is None:
            return False
        self._pools.save_checkpoint(source_slot, checkpoint.entry, hidden)
        return True

    def reserve_checkpoint(self, key: bytes, num_tokens: int) -> int | None:
        """A published checkpoint entry named `key` for a state after num_tokens tokens, which
        the caller's next forward writes (ForwardBatch.gdn_captures; its hidden state through
        `write_hidden`). None when one is already published under `key` or every entry is
        pending. The caller must not match prefixes before that forward."""
        if num_tokens % self._spec.block_size or num_tokens <= 0:
            raise ValueError(f"a checkpoint at {num_tokens} tokens is not at a block boundary")
        checkpoint = self.checkpoints.entry_for(key, num_tokens, None)
        return None if checkpoint is None else checkpoint.entry

    def write_hidden(self, entry: int, hidden: torch.Tensor) -> None:
        """The target's hidden state at the last position of a reserved checkpoint (kept only
        for the MTP layer)."""
        self._pools.write_checkpoint_hidden(entry, hidden)

    def discard(self, entries: list[int]) -> None:
        """Reserved entries whose forward failed: unpublished, their memory free again."""
        for entry in entries:
            self.checkpoints.discard(entry)

    def take_hit_hidden(self, request_id: Hashable) -> torch.Tensor | None:
        """The hidden state a prefix hit brought (once; None after, or without a hit)."""
        cache = self._get(request_id)
        hidden, cache.hit_hidden = cache.hit_hidden, None
        return hidden

    def reset(self) -> None:
        """Forgets every cached prefix nobody holds: idle cached blocks and published
        checkpoints (vLLM's reset_prefix_cache). Blocks running requests hold stay theirs and
        cached, so what they share stays read-only."""
        self._blocks.drop_idle()
        self.checkpoints.drop_published()

