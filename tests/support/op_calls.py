"""The calls of a native op (kernels/native/ops.py) as torch's profiler recorded them: the ops run
in C++, so there is no Python function of theirs to wrap and count."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def recorded_calls(op: str) -> Iterator[list[list[list[int]]]]:
    """Yields a list that, once the block has run, holds each call of hybrid_engine_cpu::<op>
    made inside it as its inputs' shapes."""
    calls: list[list[list[int]]] = []
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        yield calls
    calls.extend(e.input_shapes for e in prof.events() if e.name == f"hybrid_engine_cpu::{op}")
