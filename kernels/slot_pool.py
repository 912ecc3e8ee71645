"""Scatter into a state pool indexed by slot (GDN states, conv windows)."""

from __future__ import annotations

import torch


def scatter_to_slots(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor) -> None:
    """pool[slots[i]] = values[i] in place, skipping entries whose slot is negative (padding).

    pool: [S, ...]; slots: [M] int64; values: [M, ...] (cast to pool.dtype).
    """
    keep = slots >= 0
    if bool(keep.all()):
        pool.index_copy_(0, slots, values.to(pool.dtype))   # much faster than pool[slots] = values
    else:
        pool[slots[keep]] = values[keep].to(pool.dtype)
