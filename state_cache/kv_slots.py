"""The flat KV slots a block table maps positions to (the one home of that formula)."""

from __future__ import annotations


def kv_slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat KV slots (block * block_size + offset) of positions start..end-1: one range per block."""
    slots = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        lo, hi = max(start, b * block_size), min(end, (b + 1) * block_size)
        base = block_table[b] * block_size - b * block_size
        slots.extend(range(base + lo, base + hi))
    return slots
