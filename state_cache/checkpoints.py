"""GDN state checkpoints for prefix caching: the conv window and recurrent state of every GDN
layer after exactly L tokens, keyed by the hash of the KV block chain up to L.

A KV block can be shared as it is, but a GDN state is one running summary of the whole
prefix: a request resuming after L cached tokens needs the state at exactly L, which only a
checkpoint taken there holds. Each checkpoint also keeps the target's final-normed hidden
state at position L-1: the MTP layer's KV entry at L-1 pairs it with token L, which the
resuming request may change, so that one entry is recomputed from it.

Entries are either published (found by key, least recently used evicted first when a new one
needs room) or pending: owned by a running request, which refreshes it as its committed
length crosses block boundaries while decoding and publishes it when it finishes or is
preempted (so the next chat turn, or its own readmission, hits). Pending entries are never
evicted. The pool's size is fixed at start-up, inside the one cache byte budget, from what the
requests' slots and KV leave (HybridCacheManager.from_budget: fewer than asked, or none, when
the budget is short); taking a checkpoint is best effort: with every entry pending, none is taken.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

from .spec import CacheSpec


@dataclass
class Checkpoint:
    entry: int
    num_tokens: int
    key: bytes


class CheckpointPool:
    """Which checkpoint entry holds which prefix (the entries' memory is CachePools')."""

    def __init__(self, num_checkpoints: int):
        if num_checkpoints < 0:
            raise ValueError(f"cannot keep {num_checkpoints} prefix checkpoints")
        self.size = num_checkpoints
        self._free: deque[int] = deque(range(num_checkpoints))
        self._published: OrderedDict[bytes, Checkpoint] = OrderedDict()   # least recently used first
        self._pending: dict[Hashable, Checkpoint] = {}

    @staticmethod
    def bytes_per_checkpoint(spec: CacheSpec) -> int:
        return spec.bytes_per_slot + spec.hidden_size * spec.kv_dtype.itemsize

    # -- lookups --------------------------------------------------------------------------

    def find(self, key: bytes) -> Checkpoint | None:
        return self._published.get(key)

    def touch(self, key: bytes) -> None:
        self._published.move_to_end(key)

    def published(self) -> list[Checkpoint]:
        return list(self._published.values())

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_free(self) -> int:
        return len(self._free)

    # -- verbs ----------------------------------------------------------------------------

    def entry_for(self, key: bytes, num_tokens: int, owner: Hashable | None) -> Checkpoint | None:
        """Where to write a checkpoint of num_tokens tokens named `key`: a published one
        (owner None) or `owner`'s pending one (its earlier pending entry is reused). None when
        one is already published under `key`, or no entry can be had without evicting a
        pending one. The caller writes the state into the entry's memory at once."""
        if key in self._published:
            self._published.move_to_end(key)
            return None
        old = self._pending.pop(owner, None) if owner is not None else None
        if old is not None:
            entry = old.entry
        elif self._free:
            entry = self._free.popleft()
        elif self._published:
            _, evicted = self._published.popitem(last=False)
            entry = evicted.entry
        else:
            return None
        ckpt = Checkpoint(entry, num_tokens, key)
        if owner is None:
            self._published[key] = ckpt
        else:
            self._pending[owner] = ckpt
        return ckpt

    def drop_published(self) -> None:
        """Forgets every published checkpoint; pending ones stay with their owners."""
        self._free.extend(c.entry for c in self._published.values())
        self._published.clear()

    def release(self, owner: Hashable) -> None:
        """`owner` finished or was preempted: its pending checkpoint becomes a published one
        (or returns to the free list when the key is already published)."""
        ckpt = self._pending.pop(owner, None)
        if ckpt is None:
            return
        if ckpt.key in self._published:
            self._free.append(ckpt.entry)
        else:
            self._published[ckpt.key] = ckpt

    def discard(self, entry: int) -> None:
        """A published entry whose state was never written (the forward meant to write a
        reserved entry failed) goes back to the free list, so no request resumes from it."""
        for key, ckpt in self._published.items():
            if ckpt.entry == entry:
                del self._published[key]
                self._free.append(entry)
                return
