"""Allocator of GDN state-slot ids (conv window + recurrent state, one slot each)."""

from __future__ import annotations

from .id_pool import IdPool


class SlotAllocator(IdPool):
    """`allocate(n)` -> n slot ids, `free(slots)`, `num_free`. A slot has one owner at most."""

    def __init__(self, num_slots: int):
        super().__init__(num_slots, "state slot")
