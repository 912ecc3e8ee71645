"""Content-addressed KV blocks: reference counts, a hash index over full blocks, and an LRU of
cached blocks that nobody holds (automatic prefix caching, as in vLLM and nano-vllm).

Every block is in exactly one of three states:
- free: holds nothing worth keeping; `allocate` hands these out first, in FIFO order;
- held: reference count >= 1. A held block may carry a content hash: then its positions are
  committed, every holder reads the same tokens there, and nobody writes it again;
- idle: reference count 0 but carrying a hash, on an LRU list. A hit revives it (`take`);
  `allocate` evicts the least recently freed one (dropping its hash) once no free block is left.

`num_free` counts free and idle blocks: both can be handed out, so cached blocks never cost a
request its admission and are evicted before anything running has to be preempted.
Every verb checks before it changes anything (CacheCapacityError / ValueError).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence

from .errors import CacheCapacityError


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: bytes | None = None) -> list[bytes]:
    """The hash of each full block of token_ids: blake2b over (the previous block's hash, the
    block's token ids), so a hash names the whole prefix up to the block's end, not only its
    own tokens. A collision would silently serve another prefix's KV, hence 128 bits rather
    than Python's 64-bit hash()."""
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent or b"", digest_size=16)
        h.update(array("q", token_ids[start:start + block_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


class PrefixBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"a pool of KV blocks cannot have {num_blocks} entries")
        self.size = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs: dict[int, int] = {}                 # held block -> reference count
        self._hash_of: dict[int, bytes] = {}            # held or idle block -> its content hash
        self._block_of: dict[bytes, int] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()   # least recently freed first

    # -- counts ---------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: free ones and idle cached ones."""
        return len(self._free) + len(self._idle)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        """Blocks carrying a content hash, held or idle."""
        return len(self._hash_of)

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def ref_count(self, block: int) -> int:
        return self._refs.get(block, 0)

    def hash_of(self, block: int) -> bytes | None:
        return self._hash_of.get(block)

    # -- lookups --------------------------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        return self._block_of.get(block_hash)

    def num_idle_among(self, blocks: Iterable[int]) -> int:
        """How many of these blocks `take` would move out of the free count."""
        return sum(b in self._idle for b in set(blocks))

    # -- verbs ----------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        if n < 0:
            raise ValueError(f"cannot allocate {n} KV blocks")
        if n > self.num_free:
            raise CacheCapacityError(f"asked for {n} KV blocks but only {self.num_free} of {self.size} are free")
        ids = []
        for _ in range(n):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            ids.append(block)
        return ids

    def take(self, blocks: Sequence[int]) -> None:
        """One more reference to each of these cached blocks (a prefix hit)."""
        uncached = [b for b in blocks if b not in self._hash_of]
        if uncached:
            raise ValueError(f"KV blocks {uncached} hold no cached prefix; only cached blocks can be shared")
        for b in blocks:
            self._idle.pop(b, None)
            self._refs[b] = self._refs.get(b, 0) + 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drops one reference to each block; a block nobody holds becomes idle if it is cached,
        free otherwise. Blocks go on their lists in the order given: pass a block table
        last block first so that, among one request's blocks, the deepest is evicted first
        (a chain is useless without its first blocks)."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            repeated = sorted(b for b, count in Counter(blocks).items() if count > 1)
            raise ValueError(f"KV blocks {repeated} appear more than once in one free()")
        unheld = [b for b in blocks if b not in self._refs]
        if unheld:
            raise ValueError(f"KV blocks {unheld} are not allocated (double free or foreign id)")
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b]:
                continue
            del self._refs[b]
            if b in self._hash_of:
                self._idle[b] = None
            else:
                self._free.append(b)

    def drop_idle(self) -> None:
        """Forgets every idle cached block (they become free); held blocks keep their hashes."""
        for block in self._idle:
            del self._block_of[self._hash_of.pop(block)]
            self._free.append(block)
        self._idle.clear()

    def register(self, block: int, block_hash: bytes) -> bool:
        """Marks a held, fully committed block as holding the prefix named by block_hash. False
        (and nothing changes) when another block already holds that prefix: the first stays
        the shared copy, this one remains its holder's own."""
        if block not in self._refs:
            raise ValueError(f"KV block {block} is not held; only a held block can be cached")
        old = self._hash_of.get(block)
        if old is not None:
            if old != block_hash:
                raise ValueError(f"KV block {block} is cached under another prefix; a cached block never changes")
            return True
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True
