"""The gated delta rule for decode and verify steps (T tokens per request, the state after each
token written to its slot) with the native kernel gdn_recurrent.cpp: per token one read and
one write of each state instead of the torch form's five passes, and one call per layer
instead of ~8 ops per token (kernels/gdn/recurrent.py is the reference).

The call is the operator `hybrid_engine_cpu::gdn_recurrent` (kernels/native/ops.py, C++ from the checks to the
kernel), eagerly and in compiled graphs alike. It takes any rows: where they are not
`rows_independent` (kernels/slot_pool.py) it starts them from a copy of their states, gathered first (as the torch
form does), so that parallel rows cannot race on a slot."""

from __future__ import annotations

import torch

from ..native.ops import native_ops
from ..slot_pool import DecodeRows
from . import recurrent
from .qk_norm import normalize_kq

MAX_DV = 512


def can_run_native(state_pool: torch.Tensor) -> bool:
    _, _, dk, dv = state_pool.shape
    return (state_pool.device.type == "cpu" and state_pool.dtype == torch.float32
            and state_pool.is_contiguous() and dv % 16 == 0 and dv <= MAX_DV and native_available())


# (a constant to traced graphs: compiled_steps.py marks it so, where torch.compile is imported)
def native_available() -> bool:
    return native_ops() is not None


def gdn_recurrent_native(kq: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                         state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor
                         ) -> torch.Tensor:
    """kq [B, T, H, 2, dk] (k, scaled q), decay/beta [B, T, H], v [B, T, H, dv] -> o [B, T, H, dv]
    float32. state_pool [S, H, dk, dv] float32: row b starts from read_slots[b]; the state after
    token t goes to write_slots[b, t] (< 0: not kept); rows must not share a write slot.
    `can_run_native(state_pool)` must hold."""
    return torch.ops.hybrid_engine_cpu.gdn_recurrent.default(kq, decay, beta, v, state_pool, read_slots, write_slots)


def recurrent_gated_delta_rule(q, k, v, g, beta, state_pool, read_slots, write_slots, scale=None,
                               use_qk_l2norm=True, rows: DecodeRows | None = None):
    if can_run_native(state_pool) and (rows is None or rows.independent):
        # Without the step's rows the op checks them itself, at run time, and copies the states
        # of rows that depend on each other first.
        kq = normalize_kq(q, k, v.shape[2], scale, use_qk_l2norm)        # [B, T, Hv, 2, dk]
        o = gdn_recurrent_native(kq, g.float().exp(), beta, v, state_pool, read_slots, write_slots)
        return o.to(v.dtype)
    return recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state_pool, read_slots, write_slots, scale,
                                                use_qk_l2norm, rows)
