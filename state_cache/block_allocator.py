"""Allocator of paged-KV block ids."""

from __future__ import annotations

from .id_pool import IdPool


class BlockAllocator(IdPool):
    """`allocate(n)` -> n block ids, `free(blocks)`, `num_free`. A block has one owner at most."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, "KV block")
