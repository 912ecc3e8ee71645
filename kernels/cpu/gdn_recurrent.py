"""The gated delta rule for decode and verify steps (T tokens per request, the state after each
token written to its slot) with the native kernel gdn_recurrent.cpp: per token one read and
one write of each state instead of the torch form's five passes, and one call per layer
instead of ~8 ops per token (kernels/gdn/recurrent.py is the reference)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library

SOURCE = Path(__file__).with_name("gdn_recurrent.cpp")
MAX_DV = 512


def can_run_native(state_pool: torch.Tensor) -> bool:
    _, _, dk, dv = state_pool.shape
    return (state_pool.device.type == "cpu" and state_pool.dtype == torch.float32
            and state_pool.is_contiguous() and dv % 16 == 0 and dv <= MAX_DV and native_available())


@torch.compiler.assume_constant_result      # traced graphs take the answer as a constant
def native_available() -> bool:
    return _library() is not None


def rows_independent(read: list[int], write: list[list[int]]) -> bool:
    """True when the kernel may run the rows in parallel: every read slot is valid and read by
    one row, and no row writes a slot that another row reads. (The torch form gathers every
    state before writing any, so it allows that; the engine's steps never need it.)"""
    owner = {s: b for b, s in enumerate(read)}
    if len(owner) < len(read) or min(read, default=0) < 0:
        return False
    return all(owner.get(s, b) == b for b, row in enumerate(write) for s in row)


def gdn_recurrent_native(kq: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                         state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor
                         ) -> torch.Tensor:
    """kq [B, T, H, 2, dk] (k, scaled q), decay/beta [B, T, H], v [B, T, H, dv] -> o [B, T, H, dv]
    float32. state_pool [S, H, dk, dv] float32: row b starts from read_slots[b]; the state after
    token t goes to write_slots[b, t] (< 0: not kept). The rows must be `rows_independent`."""
    B, T, H, _, dk = kq.shape
    dv = v.shape[-1]
    kq, decay, beta, v = (t.float().contiguous() for t in (kq, decay, beta, v))
    read_slots = read_slots.to(torch.int64).contiguous()
    write_slots = write_slots.to(torch.int64).contiguous()
    o = torch.empty(B, T, H, dv)
    err = _library().gdn_recurrent(kq.data_ptr(), decay.data_ptr(), beta.data_ptr(), v.data_ptr(),
                                   state_pool.data_ptr(), read_slots.data_ptr(), write_slots.data_ptr(),
                                   o.data_ptr(), state_pool.shape[0], B, T, H, dk, dv, torch.get_num_threads())
    if err:
        raise ValueError(f"gdn_recurrent: dv {dv} unsupported" if err == 1 else
                         f"gdn_recurrent: a slot outside the pool of {state_pool.shape[0]} (read "
                         f"{read_slots.tolist()}, write {write_slots.tolist()})")
    return o


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        lib.gdn_recurrent.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] + [ctypes.c_int] * 6
        lib.gdn_recurrent.restype = ctypes.c_int
    return lib
