"""StepGraphs: bucket choice, padding rows rewritten on every run, eager fallback, and (with
CUDA) captured replays matching eager runs."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine.cuda_graphs import BufferSpec, StepGraphs

K1 = 3                                        # tokens per request (verify with k = 2)


def _cu_pad(view, real):
    # padded sequences keep one k+1 block each: cu_seqlens continues by K1
    start = view[real - 1] if real else torch.zeros((), dtype=view.dtype, device=view.device)
    steps = torch.arange(1, view.shape[0] - real + 1, dtype=view.dtype, device=view.device)
    view[real:] = start + K1 * steps if real else K1 * (steps - 1)


SPECS = {
    "tokens": BufferSpec((), torch.float32, pad=0.0, rows_per_request=K1),
    "write_slots": BufferSpec((K1,), torch.int64, pad=-1),
    "cu_seqlens": BufferSpec((), torch.int64, pad=_cu_pad, extra_rows=1),
}


def _step(inputs):
    # a stand-in for a verify forward: per-token output, plus the row's slots and cu bounds
    tokens = inputs["tokens"].view(-1, K1)
    slots = inputs["write_slots"].float()
    cu = inputs["cu_seqlens"].float()
    return (torch.cat([tokens * 2 + slots, (cu[1:] - cu[:-1])[:, None]], dim=1),)


def _inputs(B, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randn(B * K1, generator=gen).to(device),
            "write_slots": torch.randint(0, 50, (B, K1), generator=gen).to(device),
            "cu_seqlens": (K1 * torch.arange(B + 1)).to(device)}


def _check_runs(graphs, device):
    for B, seed in [(3, 0), (1, 1), (4, 2), (2, 3), (7, 4)]:
        x = _inputs(B, device, seed)
        for name, value in x.items():          # the caller writes the real rows into the buffers
            graphs.buffers[name][:value.shape[0]].copy_(value)
        (out,) = graphs.run(B)
        torch.testing.assert_close(out.clone(), _step(x)[0])
        bucket = graphs.bucket_for(B)
        if bucket is not None:                 # the padding rows hold pad values, not stale rows
            v = graphs.views(bucket)
            assert bool((v["write_slots"][B:] == -1).all())
            assert bool((v["tokens"][B * K1:] == 0).all())
            assert torch.equal(v["cu_seqlens"], K1 * torch.arange(bucket + 1, device=device))


def _caller_buffers(rows):
    # larger than the largest bucket needs, as the engine's step-input buffers are
    return {name: torch.zeros(spec.rows(rows), *spec.row_shape, dtype=spec.dtype) for name, spec in SPECS.items()}


def test_buckets_padding_and_eager_fallback_without_graphs():
    graphs = StepGraphs(_step, SPECS, buckets=[4, 2], device="cpu", output_rows_per_request=1,
                        buffers=_caller_buffers(8))
    assert [graphs.bucket_for(b) for b in (1, 2, 3, 4, 5)] == [2, 2, 4, 4, None]
    graphs.capture()                           # no-op without CUDA
    assert not graphs.graphs
    _check_runs(graphs, "cpu")


def test_buffers_too_small_for_the_largest_bucket_are_refused():
    with pytest.raises(ValueError, match="'tokens'"):
        StepGraphs(_step, SPECS, buckets=[4, 2], device="cpu", buffers=_caller_buffers(3))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_replays_match_eager():
    graphs = StepGraphs(_step, SPECS, buckets=[1, 2, 4], device="cuda")
    graphs.capture()
    assert sorted(graphs.graphs) == [1, 2, 4]
    addresses = {name: buf.data_ptr() for name, buf in graphs.buffers.items()}
    _check_runs(graphs, "cuda")
    assert {name: buf.data_ptr() for name, buf in graphs.buffers.items()} == addresses
