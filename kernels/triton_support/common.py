"""Launch-side helpers shared by the triton ops."""

from __future__ import annotations

import os

import torch


def contiguous_last(x: torch.Tensor) -> torch.Tensor:
    """Kernels take any outer strides but need unit stride on the last dim."""
    return x if x.stride(-1) == 1 else x.contiguous()


def checks_enabled(x: torch.Tensor) -> bool:
    """Host-side precondition checks sync the device, so on a GPU they are opt-in."""
    return not x.is_cuda or os.environ.get("HYBRID_ENGINE_KERNEL_CHECKS") == "1"


def check_private_write_slots(read_slots: torch.Tensor, write_slots: torch.Tensor) -> None:
    """The slot-pool kernels run one program per row at once, so a row may write its own read
    slot (it holds its state in registers) but not another row's read slot, and two rows may
    not share a write slot. The torch ops gather first and allow the former; the engine never
    needs it, since a request's committed and draft slots are its own.
    """
    if not checks_enabled(write_slots):
        return
    B = write_slots.shape[0]
    rows = torch.arange(B, device=write_slots.device)[:, None].expand_as(write_slots)
    valid = write_slots >= 0
    w, w_rows = write_slots[valid], rows[valid]
    clash = (w[:, None] == read_slots[None, :]) & (w_rows[:, None] != rows[:, 0][None, :])
    if bool(clash.any()):
        raise ValueError("triton slot-pool kernels: a row writes another row's read slot")
    shared = (w[:, None] == w[None, :]) & (w_rows[:, None] != w_rows[None, :])
    if bool(shared.any()):
        raise ValueError("triton slot-pool kernels: two rows share a write slot")
