"""Plain gated-delta-rule decode (one token per request, each state updated in its own slot)
with the native kernel gdn_decode.cpp: one read and one write of each state instead of the
torch form's five passes (kernels/gdn/recurrent.py `_decode_in_place` is the reference)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library

SOURCE = Path(__file__).with_name("gdn_decode.cpp")
MAX_DV = 512


def can_decode_in_place(state_pool: torch.Tensor) -> bool:
    _, _, dk, dv = state_pool.shape
    return (state_pool.device.type == "cpu" and state_pool.dtype == torch.float32
            and state_pool.is_contiguous() and dv % 16 == 0 and dv <= MAX_DV
            and not torch.compiler.is_compiling() and _library() is not None)


def gdn_decode_in_place(kq: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, v: torch.Tensor,
                        state_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """kq [B, H, 2, dk] (k, scaled q), decay/beta [B, H], v [B, H, dv] -> o [B, H, dv] float32;
    state_pool [S, H, dk, dv] float32 updated at the B distinct `slots`."""
    B, H, _, dk = kq.shape
    dv = v.shape[-1]
    kq, decay, beta, v = (t.float().contiguous() for t in (kq, decay, beta, v))
    slots = slots.to(torch.int64).contiguous()
    o = torch.empty(B, H, dv)
    _library().gdn_decode_in_place(kq.data_ptr(), decay.data_ptr(), beta.data_ptr(), v.data_ptr(),
                                   state_pool.data_ptr(), slots.data_ptr(), o.data_ptr(),
                                   B, H, dk, dv, torch.get_num_threads())
    return o


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_library(SOURCE)
    if lib is not None:
        lib.gdn_decode_in_place.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int] * 5
        lib.gdn_decode_in_place.restype = ctypes.c_int
    return lib
