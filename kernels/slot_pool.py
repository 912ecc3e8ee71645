"""Scatter into a state pool indexed by slot (GDN states, conv windows)."""

from __future__ import annotations

import torch


def slots_valid(slots: torch.Tensor) -> bool:
    """True when no slot is negative (no padding). slots: [M] or [B, T]. Decode-sized tensors
    are read back as Python ints, which dispatches no op; large ones (a prefill's KV slots)
    are reduced first. Under torch.compile nothing is read back: traced steps must carry no
    padding (hybrid_engine/compiled_steps.py compiles only unpadded decode and verify steps)."""
    if torch.compiler.is_compiling():
        return True
    if slots.numel() > 64:
        return int(slots.min()) >= 0
    values = slots.tolist()
    if slots.dim() > 1:
        values = [v for row in values for v in row]
    return min(values, default=0) >= 0


def scatter_to_slots(pool: torch.Tensor, slots: torch.Tensor, values: torch.Tensor,
                     valid: bool | None = None) -> None:
    """pool[slots[i]] = values[i] in place, skipping entries whose slot is negative (padding).

    pool: [S, ...]; slots: [M] int64; values: [M, ...] (cast to pool.dtype). valid: the caller's
    slots_valid(slots) (or of a tensor that holds them), saving the check when it writes from
    one slot tensor several times; None: checked here.
    """
    if valid is None:
        valid = slots_valid(slots)
    if values.dtype != pool.dtype:
        values = values.to(pool.dtype)
    if valid:
        pool.index_copy_(0, slots, values)                   # much faster than pool[slots] = values
    else:
        keep = slots >= 0
        pool[slots[keep]] = values[keep]
