"""Replays a torch.compile'd function's last graph call when it is called again with the very same
argument objects (compiled_steps.py: the steady-state decode).

Every call of a torch.compile'd function pays, before its graph runs, dynamo's cache lookup
(the guards: the arguments' sizes, dtypes, host ints) and the graph's prologue, bytecode that
walks the arguments and collects the graph's inputs (tensors, and the ints of their dynamic
sizes, strides and offsets, each through a small wrapper call): a visible share of a small
model's compiled decode step (benchmarks/RESULTS.md). When a call's arguments are the last
call's own objects, neither can give anything new: the guards read only the arguments and state
that is fixed while an engine runs (the modules and globals they skip are
`compiled_steps._engine_guards`'s), and the inputs are the same tensors with the same sizes. So
such a call runs the last call's graph on its recorded inputs directly.

For a backend whose graphs take their ints as tensors (`ints_as_tensors`: inductor's C++
wrapper turns every non-tensor input into a 0-d int64 tensor, `torch.tensor(arg)`, at each call
before it reads the value back in C++: a dozen per default-model decode step), the recorded
ints (dynamic sizes, strides, offsets) are kept as those tensors: replayed ints never change,
so that is done once.

What the caller guarantees (StepInputBuilder's steady state does): an argument that is passed
again as the same object reaches the same tensors, unchanged but for their values (no field of
the ForwardBatch reassigned, no pool of the cache manager replaced (state_cache allocates them
once), no tensor resized or restrided in place; values may change: the graph reads them), and
the compiled function changes no Python state (dynamo would replay such a change after the
graph; a replay would not). A replay is offered only where the call ran exactly one graph and
returned the graph's outputs as they are: the function's bytecode around the graph then does
nothing else (no graph break, no output it builds itself). Nothing here reads dynamo's
internals: the graph and its inputs are what the backend was handed.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch


class GraphReplay:
    """`backend(b)` wraps a torch.compile backend so that every graph it compiles records its
    calls here; `call(compiled_fn, *args)` runs compiled_fn(*args), or replays a recorded graph
    call when args are that call's argument objects. One GraphReplay per compiled function
    whose calls it replays (its last `keep` replayable calls are the ones replayed)."""

    def __init__(self, ints_as_tensors: bool = False, keep: int = 1):
        self._ints_as_tensors = ints_as_tensors
        self._calls: list[tuple[Callable, tuple, Any]] | None = None   # graph calls of the current call
        # Replayable calls, the latest first, at most `keep`: (arguments, graph, the graph's
        # recorded inputs). More than one where a caller alternates between a few argument sets
        # (the MTP drafting after verifies that accepted different numbers of drafts).
        self._keep = keep
        self._records: list[tuple[tuple, Callable, tuple]] = []
        self.replays = 0                      # calls replayed (tests and benchmarks read it)

    def backend(self, backend: Callable) -> Callable:
        def recording_backend(graph, example_inputs):
            compiled = backend(graph, example_inputs)

            def recorded(*inputs):
                out = compiled(*inputs)
                if self._calls is not None:       # inside call(): other callers' calls are not kept
                    self._calls.append((compiled, inputs, out))
                return out
            return recorded
        return recording_backend

    def call(self, compiled_fn: Callable, *args):
        for i, (recorded_args, graph, inputs) in enumerate(self._records):
            if len(recorded_args) == len(args) and all(map(operator.is_, args, recorded_args)):
                if i:
                    self._records.insert(0, self._records.pop(i))
                self.replays += 1
                return tuple(graph(*inputs))
        self._calls = calls = []
        try:
            result = compiled_fn(*args)
        finally:
            self._calls = None
        if len(calls) == 1 and _is_graph_output(result, calls[0][2]):
            inputs = _ints_as_tensors(calls[0][1]) if self._ints_as_tensors else calls[0][1]
            self._records = [(args, calls[0][0], inputs), *self._records][:self._keep]
        return result


def _ints_as_tensors(inputs: tuple) -> tuple:
    """The graph inputs with each int as the 0-d int64 tensor the C++ wrapper would make of it
    (bools stay: they are ints to Python, not to the wrapper)."""
    return tuple(torch.tensor(x) if type(x) is int else x for x in inputs)


def _is_graph_output(result, graph_out) -> bool:
    """The function returned a tuple of exactly the graph's outputs, in order."""
    return (isinstance(result, tuple) and isinstance(graph_out, (tuple, list)) and len(result) == len(graph_out)
            and all(map(operator.is_, result, graph_out)))
