"""Runs one forward over a packed mixed batch and returns logits for the rows that sample."""

from __future__ import annotations

import torch

from hybrid_engine.models import HybridForCausalLM
from hybrid_engine.state_cache import HybridCacheManager

from .step_inputs import StepInputs


class ModelRunner:
    def __init__(self, model: HybridForCausalLM, cache: HybridCacheManager):
        self.model = model
        self.cache = cache
        model.pack_weights()        # CPU bf16/fp16: oneDNN's weight layout (models/linear.py)

    @torch.inference_mode()
    def forward(self, inputs: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (final-normed hidden [T, H] for the MTP drafter, float32 logits [rows, vocab]);
        lm_head runs only on the rows that sample."""
        hidden = self.model(inputs.input_ids, inputs.batch, self.cache)
        return hidden, self.model.compute_logits(hidden[inputs.batch.logits_indices]).float()
