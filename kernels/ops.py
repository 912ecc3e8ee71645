"""The public ops: every op's torch reference under its op name (what the `torch` backend runs),
and the backends an engine chooses from (kernels/backends.py)."""

from .backends import (BACKENDS, KernelBackend, TORCH_OPS, cpu_backend, make_backend, torch_backend,
                       triton_backend)
from .gdn import naive_gated_delta_rule
from .rope import rope_cos_sin

add_rms_norm = TORCH_OPS["add_rms_norm"]
apply_partial_rope = TORCH_OPS["apply_partial_rope"]
causal_conv1d_update = TORCH_OPS["causal_conv1d_update"]
causal_conv1d_varlen = TORCH_OPS["causal_conv1d_varlen"]
chunk_gated_delta_rule = TORCH_OPS["chunk_gated_delta_rule"]
conv_windows_at = TORCH_OPS["conv_windows_at"]
gated_rms_norm = TORCH_OPS["gated_rms_norm"]
gdn_decode = TORCH_OPS["gdn_decode"]
paged_attention = TORCH_OPS["paged_attention"]
qk_norm_rope = TORCH_OPS["qk_norm_rope"]
recurrent_gated_delta_rule = TORCH_OPS["recurrent_gated_delta_rule"]
rms_norm = TORCH_OPS["rms_norm"]
silu_mul = TORCH_OPS["silu_mul"]
write_kv_cache = TORCH_OPS["write_kv_cache"]

__all__ = [
    "BACKENDS",
    "KernelBackend",
    "add_rms_norm",
    "apply_partial_rope",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "conv_windows_at",
    "cpu_backend",
    "gated_rms_norm",
    "gdn_decode",
    "make_backend",
    "naive_gated_delta_rule",
    "paged_attention",
    "qk_norm_rope",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "rope_cos_sin",
    "silu_mul",
    "torch_backend",
    "triton_backend",
    "write_kv_cache",
]
