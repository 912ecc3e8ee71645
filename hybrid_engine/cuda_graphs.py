"""CUDA graphs for decode and verify steps, over persistent input buffers (seed 002).

A decode or verify step has the same shape for every batch of B requests (B rows of k+1
tokens), so the step can be captured once per batch-size bucket and replayed. The rules:

- Inputs live in persistent buffers sized for the largest bucket, allocated once: a graph
  reads fixed addresses. The caller writes a step's real rows into them (the engine's step
  inputs are packed there in the first place: hybrid_engine/step_inputs.py), so a run only
  pads the rows after them.
- A batch of B runs the graph of the smallest bucket >= B. Rows B..bucket are padding and
  are rewritten with their pad value on every run, never left stale from a larger batch.
  Pad values must make a row harmless: write slots and KV slots -1 (skipped writes), read
  slots and block ids pointing at a valid scratch entry, one token per padded sequence.
- Capture happens only at warm-up (`capture()`), largest bucket first, sharing one memory
  pool; a batch larger than every bucket runs eagerly on the caller's tensors.
- The returned output is a view of the graph's static output: consume or copy it before
  the next run.

Kernels inside a captured step must not synchronise with the host (no `.item()`, no
`bool(tensor)`): the triton backend's decode path is written that way; the torch
backend's is not (it is not meant to be captured).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

Pad = float | int | Callable[[torch.Tensor, int], None]


@dataclass(frozen=True)
class BufferSpec:
    """One step input: `rows_per_request * B + extra_rows` rows of shape `row_shape`.

    pad: the value padding rows get, or a function `pad(buffer_view, num_real_rows)` that
    fills rows num_real_rows.. of the bucket's view (e.g. cu_seqlens continuing by k+1).
    """

    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: Pad
    rows_per_request: int = 1
    extra_rows: int = 0

    def rows(self, batch_size: int) -> int:
        return self.rows_per_request * batch_size + self.extra_rows


class StepGraphs:
    """Runs `step(inputs) -> tuple of Tensors` for B requests through captured graphs per bucket.

    step: takes a dict of input tensors (views of the persistent buffers) and returns a tuple
    of tensors, each with `output_rows_per_request * bucket` leading rows. buffers: the
    persistent input tensors, name -> at least `spec.rows(largest bucket)` rows of the spec's
    row shape (None: allocated here).
    """

    def __init__(self, step: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, ...]],
                 specs: dict[str, BufferSpec], buckets: Sequence[int], device: torch.device | str,
                 output_rows_per_request: int = 1, use_graphs: bool | None = None, warmup_runs: int = 2,
                 buffers: dict[str, torch.Tensor] | None = None):
        self.step = step
        self.specs = specs
        self.buckets = sorted(set(buckets))
        self.output_rows_per_request = output_rows_per_request
        self.device = torch.device(device)
        self.use_graphs = (self.device.type == "cuda") if use_graphs is None else use_graphs
        self.warmup_runs = warmup_runs
        largest = self.buckets[-1]
        if buffers is None:
            buffers = {name: torch.empty(spec.rows(largest), *spec.row_shape, dtype=spec.dtype,
                                         device=self.device)
                       for name, spec in specs.items()}
        for name, spec in specs.items():
            buf = buffers[name]
            if buf.shape[0] < spec.rows(largest) or tuple(buf.shape[1:]) != spec.row_shape or buf.dtype != spec.dtype:
                raise ValueError(f"buffer {name!r} {tuple(buf.shape)} {buf.dtype} cannot hold "
                                 f"{spec.rows(largest)} rows of {spec.row_shape} {spec.dtype}")
        self.buffers = buffers
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}

    def bucket_for(self, batch_size: int) -> int | None:
        for bucket in self.buckets:
            if bucket >= batch_size:
                return bucket
        return None

    def views(self, bucket: int) -> dict[str, torch.Tensor]:
        return {name: buf[:self.specs[name].rows(bucket)] for name, buf in self.buffers.items()}

    def capture(self) -> None:
        """Warm up (compiling the kernels) and capture every bucket, on all-padding inputs."""
        if not self.use_graphs:
            return
        pool = None
        for bucket in reversed(self.buckets):
            views = self._pad(bucket, 0)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(self.warmup_runs):
                    self.step(views)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self.step(views)
            pool = graph.pool()
            self.graphs[bucket] = graph

    def run(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        """A step of batch_size requests, whose `spec.rows(batch_size)` leading rows the caller
        has written into the buffers. Returns the real rows."""
        bucket = self.bucket_for(batch_size)
        if bucket is None:                                     # eager fallback on the real rows
            return self.step({name: buf[:self.specs[name].rows(batch_size)] for name, buf in self.buffers.items()})
        views = self._pad(bucket, batch_size)
        if bucket in self.graphs:
            self.graphs[bucket].replay()
            outs = self.outputs[bucket]
        else:
            outs = self.step(views)
        rows = self.output_rows_per_request * batch_size
        return tuple(out[:rows] for out in outs)

    def _pad(self, bucket: int, batch_size: int) -> dict[str, torch.Tensor]:
        """The bucket's views, with every row after the real ones set to its pad value."""
        views = self.views(bucket)
        for name, spec in self.specs.items():
            view = views[name]
            real = spec.rows(batch_size) if batch_size else 0
            if callable(spec.pad):
                spec.pad(view, real)
            elif real < view.shape[0]:
                view[real:].fill_(spec.pad)
        return views
