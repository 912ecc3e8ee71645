"""Torch (CPU reference) backend of the engine's kernels.

Ops take tensors and flags only; nothing here knows about models or the engine.
"""

from .attention import paged_attention, write_kv_cache
from .conv import causal_conv1d_update, causal_conv1d_varlen
from .gdn import chunk_gated_delta_rule, naive_gated_delta_rule, recurrent_gated_delta_rule
from .norm import gated_rms_norm, rms_norm
from .rope import apply_partial_rope, rope_cos_sin

__all__ = [
    "apply_partial_rope",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "gated_rms_norm",
    "naive_gated_delta_rule",
    "paged_attention",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rope_cos_sin",
    "write_kv_cache",
]
