"""Shared inputs for the triton-vs-torch tests (float32, tiny shapes)."""

from __future__ import annotations

import torch

from hybrid_engine import kernels
from kernel_cases import gdn_inputs, make_cu  # noqa: F401  (re-exported for the triton tests)

TORCH = {name: getattr(kernels, name).torch_op for name in (
    "add_rms_norm", "apply_partial_rope", "causal_conv1d_update", "causal_conv1d_varlen", "chunk_gated_delta_rule",
    "gated_rms_norm", "gdn_decode", "paged_attention", "qk_norm_rope", "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_fused_gating", "rms_norm", "write_kv_cache")}


