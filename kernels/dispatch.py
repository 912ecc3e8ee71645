"""Backend selection for the kernel ops: `torch` (reference, runs everywhere) or `triton`.

    auto    triton on CUDA when triton imports; torch otherwise
    torch   always the torch ops
    triton  always the triton ops (on CPU tensors only under TRITON_INTERPRET=1: tests)

An engine picks its backend once, at construction (`KernelBackend.for_device`, from the
default mode below), and every step's ForwardBatch carries it to the layers: nothing is
looked up per op call on the engine's path.

The default mode starts from HYBRID_ENGINE_KERNEL_BACKEND (default auto) and can be changed
with `set_backend` or, for a block of code, `using_backend`; it decides the backend of engines
made while it holds and of the module-level ops (`kernels.rms_norm`, ...), which pick per call
by their first tensor's device (for tests and scripts). The triton package (and fla) is
imported on first use, so a torch-only process never pays for it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Iterator

BACKENDS = ("auto", "torch", "triton")

_mode = "auto"
_triton_ops = None
_triton_importable: bool | None = None


def set_backend(name: str) -> None:
    global _mode
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; one of {BACKENDS}")
    _mode = name


def get_backend() -> str:
    return _mode


@contextlib.contextmanager
def using_backend(name: str) -> Iterator[None]:
    previous = _mode
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


def triton_available() -> bool:
    global _triton_importable
    if _triton_importable is None:
        _triton_importable = importlib.util.find_spec("triton") is not None
    return _triton_importable


def _triton_backend():
    global _triton_ops
    if _triton_ops is None:
        from . import triton as ops
        _triton_ops = ops
    return _triton_ops


class KernelBackend:
    """One backend's ops as attributes (`backend.rms_norm(...)`), bound once."""

    def __init__(self, name: str, ops: dict[str, Callable]):
        self.name = name
        for op_name, op in ops.items():
            setattr(self, op_name, op)

    @classmethod
    def for_device(cls, device, torch_ops: dict[str, Callable]) -> KernelBackend:
        """The default mode's backend for tensors on `device`."""
        on_cuda = str(device).startswith("cuda")
        if _mode == "torch" or (_mode == "auto" and not (on_cuda and triton_available())):
            return cls("torch", torch_ops)
        triton_ops = _triton_backend()
        return cls("triton", {name: getattr(triton_ops, name) for name in torch_ops})

    def __repr__(self) -> str:
        return f"KernelBackend({self.name!r})"


def dispatched(torch_op: Callable) -> Callable:
    """Wraps a torch op so each call picks its backend: one mode check on the torch path."""
    name = torch_op.__name__

    @functools.wraps(torch_op)
    def op(*args, **kwargs):
        mode = _mode
        if mode == "torch" or (mode == "auto" and not (
                (args[0] if args else next(iter(kwargs.values()))).is_cuda and triton_available())):
            return torch_op(*args, **kwargs)
        return getattr(_triton_backend(), name)(*args, **kwargs)

    op.torch_op = torch_op
    return op


set_backend(os.environ.get("HYBRID_ENGINE_KERNEL_BACKEND", "auto"))
