"""Allocator of paged-KV block ids, and the flat slots a block table maps positions to."""

from __future__ import annotations

from .id_pool import IdPool


class BlockAllocator(IdPool):
    """`allocate(n)` -> n block ids, `free(blocks)`, `num_free`. A block has one owner at most."""

    def __init__(self, num_blocks: int):
        super().__init__(num_blocks, "KV block")


def kv_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV slots (block * block_size + offset) of positions start..end-1: one range per block."""
    slots = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
        base = block_table[b] * block_size - b * block_size
        slots.extend(range(base + lo, base + hi))
    return slots
