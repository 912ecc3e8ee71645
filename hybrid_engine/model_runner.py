"""Runs one forward over a packed mixed batch and returns logits for the rows that sample."""

from __future__ import annotations

import torch

from hybrid_engine.models import HybridForCausalLM
from hybrid_engine.state_cache import HybridCacheManager

from .compiled_steps import CompiledSteps
from .decode_graphs import DecodeGraphs
from .step_inputs import StepInputs


class ModelRunner:
    """decode_graphs: when given (CUDA, hybrid_engine/decode_graphs.py), pure decode and
    verify steps of a captured batch size replay a graph. compiled: when given
    (hybrid_engine/compiled_steps.py), pure decode and verify steps run torch.compile'd.
    Every other step runs eagerly."""

    def __init__(self, model: HybridForCausalLM, cache: HybridCacheManager,
                 decode_graphs: DecodeGraphs | None = None, compiled: CompiledSteps | None = None):
        self.model = model
        self.cache = cache
        self.decode_graphs = decode_graphs
        self.compiled = compiled
        if decode_graphs is not None:
            with torch.inference_mode():
                decode_graphs.capture()

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden [T, H] for the MTP drafter, float32 logits [rows, vocab]);
        lm_head runs only on the rows that sample. With graphs, both are views of the graph's
        static outputs: consumed within the step."""
        if self.decode_graphs is not None and self.decode_graphs.handles(inputs):
            return self.decode_graphs.run(inputs)
        if self.compiled is not None and self.compiled.handles(inputs.batch):
            return self.compiled.run(inputs.input_ids, inputs.batch, self.cache.pools)
        return self.model.forward_step(inputs.input_ids, inputs.batch, self.cache.pools)
