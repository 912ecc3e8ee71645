"""Triton (GPU) backend of the engine's kernels: same names and contracts as the torch ops.

Imported by kernels/backends.py when an engine chooses this backend (importing
fla takes seconds). On CPU tensors these kernels run only under TRITON_INTERPRET=1 with
`interpreter_shim.install()` applied, which is how tests/triton checks them.
"""

from .attention import paged_attention, write_kv_cache
from .conv import causal_conv1d_update, causal_conv1d_varlen, conv_windows_at
from .gdn import chunk_gated_delta_rule, recurrent_gated_delta_rule
from .gdn_decode import gdn_decode
from .norm import add_rms_norm, apply_partial_rope, gated_rms_norm, qk_norm_rope, rms_norm

__all__ = [
    "add_rms_norm",
    "apply_partial_rope",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "conv_windows_at",
    "gated_rms_norm",
    "gdn_decode",
    "paged_attention",
    "qk_norm_rope",
    "recurrent_gated_delta_rule",
    "rms_norm",
    "write_kv_cache",
]
