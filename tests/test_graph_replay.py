"""GraphReplay (hybrid_engine/graph_replay.py): a call with the last call's own argument objects
runs the last graph on its recorded inputs (reading the tensors' current values); any other call
goes through dynamo, and calls whose frame did more than run one graph are never replayed.
Graphs here run as traced (the FX graph's own forward), which is all replay depends on."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hybrid_engine.graph_replay import GraphReplay


@dataclass
class _Step:
    scale: torch.Tensor
    offset: int                 # a host int: dynamo guards on it


class _Counting:
    """A backend that counts the graphs it compiles and the calls each gets."""

    def __init__(self):
        self.compiled = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.compiled += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)
        return run


def _compiled(fn, replay: GraphReplay, backend: _Counting):
    torch._dynamo.reset()
    return torch.compile(fn, backend=replay.backend(backend), dynamic=False)


def _scaled(x: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * step.scale + step.offset
    return y, y.sum()


def test_same_objects_replay_and_read_current_values():
    replay, backend = GraphReplay(), _Counting()
    f = _compiled(_scaled, replay, backend)
    x, step = torch.arange(4.0), _Step(torch.tensor(2.0), 1)
    first = replay.call(f, x, step)
    assert torch.equal(first[0], x * 2 + 1)
    frames = torch._dynamo.utils.counters["stats"]["calls_captured"]
    x.add_(1)                    # values change in place (the steady state's new tokens)
    step.scale.fill_(3.0)
    again = replay.call(f, x, step)
    assert torch.equal(again[0], x * 3 + 1) and again[1].item() == (x * 3 + 1).sum().item()
    assert backend.calls == 2 and backend.compiled == 1
    # the replay did not enter dynamo: no new frame was captured, and no guard ran
    assert torch._dynamo.utils.counters["stats"]["calls_captured"] == frames


def test_other_objects_go_through_dynamo():
    replay, backend = GraphReplay(), _Counting()
    f = _compiled(_scaled, replay, backend)
    x, step = torch.arange(4.0), _Step(torch.tensor(2.0), 1)
    replay.call(f, x, step)
    # A new object with another host int: dynamo's guards fail and it compiles again.
    other = _Step(step.scale, 5)
    out = replay.call(f, x, other)
    assert torch.equal(out[0], x * 2 + 5) and backend.compiled == 2
    # A new tensor of another shape, same batch object: dynamo again.
    wide = torch.arange(6.0)
    out = replay.call(f, wide, other)
    assert torch.equal(out[0], wide * 2 + 5) and backend.compiled == 3
    # And the last call is the one replayed.
    wide.fill_(1.0)
    out = replay.call(f, wide, other)
    assert torch.equal(out[0], torch.full((6,), 7.0)) and backend.compiled == 3 and backend.calls == 4


def test_keep_replays_each_of_the_latest_argument_sets():
    """keep=2: two argument sets that alternate (the MTP drafting after verifies of two lengths)
    both replay, each on its own recorded inputs; a third set pushes out the older one."""
    replay, backend = GraphReplay(keep=2), _Counting()
    f = _compiled(_scaled, replay, backend)
    x = torch.arange(4.0)
    a, b, c = _Step(torch.tensor(2.0), 1), _Step(torch.tensor(3.0), 2), _Step(torch.tensor(4.0), 3)
    replay.call(f, x, a)
    replay.call(f, x, b)
    for _ in range(2):
        for step, scale, offset in ((a, 2, 1), (b, 3, 2)):
            x.add_(1)
            out = replay.call(f, x, step)
            assert torch.equal(out[0], x * scale + offset)
    assert replay.replays == 4
    replay.call(f, x, c)                 # through dynamo: now c and b are kept, a is not
    replay.call(f, x, b)
    replay.call(f, x, a)
    assert replay.replays == 5


def _with_graph_break(x: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    y = x * step.scale
    torch._dynamo.graph_break()
    return y + step.offset, y


def _returns_an_input(x: torch.Tensor, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
    return x * step.scale, step.scale


def test_frames_that_do_more_than_one_graph_are_not_replayed():
    for fn in (_with_graph_break, _returns_an_input):
        replay, backend = GraphReplay(), _Counting()
        f = _compiled(fn, replay, backend)
        x, step = torch.arange(4.0), _Step(torch.tensor(2.0), 1)
        for _ in range(3):
            want = fn(x, step)
            got = replay.call(f, x, step)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert replay.replays == 0 and not replay._records, fn.__name__


def _rows_scaled(x: torch.Tensor, step: _Step) -> tuple[torch.Tensor]:
    return ((x * step.scale)[:step.offset].sum(1) + step.offset,)


@pytest.mark.parametrize("ints_as_tensors", [False, True])
def test_int_inputs_replay_through_the_cpp_wrapper(ints_as_tensors):
    """The engine's backend (inductor with its C++ wrapper) on a graph with an int input (a
    host int that changed between calls, so dynamo made it dynamic): a replay gives what the
    function gives on the current values, and with ints_as_tensors it hands the recorded int
    over as the 0-d int64 tensor the wrapper would make of it."""
    from hybrid_engine.compiled_steps import _inductor
    torch._dynamo.reset()
    replay = GraphReplay(ints_as_tensors=ints_as_tensors)
    f = torch.compile(_rows_scaled, backend=replay.backend(_inductor(False)))
    x = torch.arange(24.0).reshape(6, 4)
    replay.call(f, x, _Step(torch.tensor(2.0), 5))
    step = _Step(torch.tensor(2.0), 4)
    assert torch.equal(replay.call(f, x, step)[0], _rows_scaled(x, step)[0])
    ints = [v for v in replay._records[0][2] if type(v) is int or (isinstance(v, torch.Tensor) and v.dtype == torch.int64)]
    assert [int(v) for v in ints] == [4] and isinstance(ints[0], torch.Tensor) == ints_as_tensors
    x.mul_(-3)
    step.scale.fill_(0.5)
    assert torch.equal(replay.call(f, x, step)[0], _rows_scaled(x, step)[0]) and replay.replays == 1
