"""A structured output's token mask on logits rows, in torch ops (the reference; the cpu
backend's native form is kernels/sampling/cpu.py). The mask is xgrammar's: int32 words, token t
allowed where bit t % 32 of word t // 32 is set."""

from __future__ import annotations

import torch


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [N, V] (in place): -inf at every token whose bit in bitmask [N, >= ceil(V/32)] is 0."""
    vocab = logits.shape[-1]
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().flatten(1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))
