"""Scatter into a state pool indexed by slot (GDN states, conv windows), and what the slot-pool
kernels of a decode step need to know about its slots.

A decode or verify step's rows read one slot each and write one slot per token. Whether any
slot is padding, whether rows may run in parallel and whether each row writes back to the slot
it read decide which form a kernel takes; the caller knows these from the slot lists it packed
and passes them as `DecodeRows`, so no kernel reads slots back to the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """writes_valid: no write slot is negative (no padding rows). independent: no read slot is
    negative or read by two rows, and no row writes a slot another row reads (rows may run in
    parallel). in_place: one token per row, written back to the slot it read. read_ids: the read
    slots as host ints, for forms that update each row's state where it lives; None where the
    caller does not hand them down (compiled graphs would guard on every value)."""

    writes_valid: bool
    independent: bool
    in_place: bool
    read_ids: tuple[int, ...] | None = None

    @classmethod
    def of_lists(cls, read: Sequence[int], write: Sequence[Sequence[int]]) -> DecodeRows:
        """From the host lists a caller packed: read[b], write[b][t]."""
        return cls(writes_valid=all(s >= 0 for row in write for s in row),
                   independent=rows_independent(read, write),
                   in_place=all(len(row) == 1 and row[0] == r for r, row in zip(read, write)),
                   read_ids=tuple(read))

    @classmethod
    def of_tensors(cls, read_slots: torch.Tensor, write_slots: torch.Tensor) -> DecodeRows:
        """Read back from the slot tensors, for callers that hold no host lists (tests,
        benchmarks; the engine's steps never need it)."""
        return cls.of_lists(read_slots.tolist(), write_slots.tolist())

    def without_ids(self) -> DecodeRows:
        return DecodeRows(self.writes_valid, self.independent, self.in_place)


def rows_independent(read: list[int], write: list[list[int]]) -> bool:
    """True when the kernel may run the rows in parallel on the pool itself: every read slot is
    valid and read by one row, and no row writes a slot that another row reads. (The torch form
    gathers every state before writing any, so it allows that; so does the op, at the price of
    that copy; the engine's steps never need it.) kernels/native/ops.cpp checks the same per call."""
    owner = {s: b for b, s in enumerate(read)}
    if len(owner) < len(read) or min(read, default=0) < 0:
        return False
    return all(owner.get(s, b) == b for b, row in enumerate(write) for s in row)


def scatter_to_slots(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, valid: bool) -> None:
    """pool[slots[i]] = values[i] in place, skipping entries whose slot is negative (padding).

    pool: [S, ...]; slots: [M] int64; values: [M, ...] (cast to pool.dtype). valid: the caller
    knows no slot is negative (DecodeRows.writes_valid).
    """
    if values.dtype != pool.dtype:
        values = values.to(pool.dtype)
    if valid:
        pool.index_copy_(0, slots, values)                   # much faster than pool[slots] = values
    else:
        keep = slots >= 0
        pool[slots[keep]] = values[keep]
