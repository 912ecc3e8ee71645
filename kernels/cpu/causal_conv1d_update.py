"""The GDN layer's conv update for decode and verify steps (B rows of T new tokens, the window
after each token written to its slot) with the native kernel causal_conv1d_update.cpp: one
call per layer instead of the torch form's ~12 ops (kernels/conv/causal_conv1d.py
`causal_conv1d_update` is the reference, and the form taken wherever this one cannot run).

Under torch.compile and eagerly alike the call is the graph op
`hybrid_engine_cpu::causal_conv1d_update` (graph_op.py): one extern call of the graph."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from .build import load_library
from .graph_op import define_graph_op

SOURCE = Path(__file__).with_name("causal_conv1d_update.cpp")
DTYPES = (torch.float32, torch.bfloat16)
KERNEL_SIZES = (2, 3, 4)
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_ERRORS = {1: "unsupported kernel size", 2: "a slot outside the pool"}


def can_run_native(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor) -> bool:
    """Whether the kernel serves this call: CPU tensors of float32 or bf16, the pool in x's
    dtype and contiguous, channels contiguous in x, a kernel size of 2 to 4."""
    return (x.device.type == "cpu" and x.dtype in DTYPES and weight.dtype in DTYPES
            and window_pool.dtype == x.dtype and window_pool.is_contiguous() and x.stride(-1) == 1
            and weight.shape[1] in KERNEL_SIZES and native_available())


@torch.compiler.assume_constant_result      # traced graphs take the answer as a constant
def native_available() -> bool:
    return _library(None) is not None


def conv_update_native(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                       read_slots: torch.Tensor, write_slots: torch.Tensor,
                       level: str | None = None) -> torch.Tensor:
    """The reference's contract (x [B, T, D]; weight [D, K]; window_pool [S, D, K-1] in x.dtype,
    modified in place; read_slots [B]; write_slots [B, T], < 0 skipped) -> y [B, T, D] in
    x.dtype. Any slots may alias: every window is read before any is written, and writes go
    in token order, rows in order within a token. level: the kernel built for that level of
    kernels/cpu/isa.py (None: this process's; tests run each level below it)."""
    B, T, D = x.shape
    K = weight.shape[1]
    fn = _entries(level).get((x.dtype, weight.dtype))
    if fn is None or window_pool.dtype != x.dtype or not window_pool.is_contiguous():
        raise ValueError(f"conv_update_native: no kernel for x {x.dtype}, weight {weight.dtype}, pool "
                         f"{window_pool.dtype} at level {level}")
    # Each conversion only where needed: at decode sizes a few microseconds of Python are a
    # good part of the call.
    if x.stride(-1) != 1:            # rows may be strided (a column slice), channels not
        x = x.contiguous()
    if not weight.is_contiguous():
        weight = weight.contiguous()
    if read_slots.dtype != torch.int64 or not read_slots.is_contiguous():
        read_slots = read_slots.to(torch.int64).contiguous()
    if write_slots.dtype != torch.int64 or not write_slots.is_contiguous():
        write_slots = write_slots.to(torch.int64).contiguous()
    y = x.new_empty(B, T, D)
    if B == 0 or T == 0:
        return y
    err = fn(x.data_ptr(), weight.data_ptr(), window_pool.data_ptr(), read_slots.data_ptr(),
             write_slots.data_ptr(), y.data_ptr(), window_pool.shape[0], B, T, D, K, x.stride(0),
             x.stride(1), torch.get_num_threads())
    if err:
        raise ValueError(f"conv_update_native: {_ERRORS.get(err, err)} (K {K}, pool of {window_pool.shape[0]}, "
                         f"read {read_slots.tolist()}, write {write_slots.tolist()})")
    return y


def _native_op(x, weight, window_pool, read_slots, write_slots) -> torch.Tensor:
    return conv_update_native(x, weight, window_pool, read_slots, write_slots)


conv_update_op = define_graph_op(
    "causal_conv1d_update(Tensor x, Tensor weight, Tensor(a!) window_pool, Tensor read_slots, "
    "Tensor write_slots) -> Tensor", _native_op, lambda x, *_: x.new_empty(x.shape))


@functools.lru_cache(maxsize=None)
def _library(level: str | None) -> ctypes.CDLL | None:
    return load_library(SOURCE, level)


@functools.lru_cache(maxsize=None)
def _entries(level: str | None) -> dict:
    """(x dtype, weight dtype) -> the kernel's entry point (empty where none builds)."""
    lib = _library(level)
    if lib is None:
        return {}
    args = [ctypes.c_void_p] * 6 + [ctypes.c_int64] + [ctypes.c_int] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_int]
    entries = {}
    for x_dtype, x_name in _SUFFIX.items():
        for w_dtype, w_name in _SUFFIX.items():
            fn = getattr(lib, f"conv_update_{x_name}_{w_name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
            entries[x_dtype, w_dtype] = fn
    return entries
