"""A pool of integer ids (KV blocks or state slots), each owned by at most one holder."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from .errors import CacheCapacityError


class IdPool:
    """Hands out ids 0..size-1. Both verbs check everything before changing anything,
    so a refused call leaves the pool as it was."""

    def __init__(self, size: int, kind: str):
        if size < 0:
            raise ValueError(f"a pool of {kind}s cannot have {size} entries")
        self.size = size
        self.kind = kind
        # FIFO reuse (as in nano-vllm): deterministic ids, freed ids go to the back.
        self._free: deque[int] = deque(range(size))
        self._owned: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} {self.kind}s")
        if n > len(self._free):
            raise CacheCapacityError(
                f"asked for {n} {self.kind}s but only {len(self._free)} of {self.size} are free"
            )
        ids = [self._free.popleft() for _ in range(n)]
        self._owned.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        if len(set(ids)) != len(ids):
            repeated = sorted(i for i, count in Counter(ids).items() if count > 1)
            raise ValueError(f"{self.kind}s {repeated} appear more than once in one free()")
        unowned = [i for i in ids if i not in self._owned]
        if unowned:
            raise ValueError(f"{self.kind}s {unowned} are not allocated (double free or foreign id)")
        self._owned.difference_update(ids)
        self._free.extend(ids)
