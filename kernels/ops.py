"""The public ops, each dispatched to its backend per call, and the backend an engine takes."""

from . import attention as _attention
from . import conv as _conv
from . import fused as _fused
from . import gdn as _gdn
from . import norm as _norm
from . import rope as _rope
from .dispatch import KernelBackend, dispatched, get_backend, set_backend, using_backend
from .gdn import naive_gated_delta_rule
from .fused import decode_kernel_serves_prefill
from .rope import rope_cos_sin

add_rms_norm = dispatched(_norm.add_rms_norm)
apply_partial_rope = dispatched(_rope.apply_partial_rope)
causal_conv1d_update = dispatched(_conv.causal_conv1d_update)
causal_conv1d_varlen = dispatched(_conv.causal_conv1d_varlen)
conv_windows_at = dispatched(_conv.conv_windows_at)
chunk_gated_delta_rule = dispatched(_gdn.chunk_gated_delta_rule)
gated_rms_norm = dispatched(_norm.gated_rms_norm)
gdn_decode = dispatched(_fused.gdn_decode)
paged_attention = dispatched(_attention.paged_attention)
qk_norm_rope = dispatched(_fused.qk_norm_rope)
recurrent_gated_delta_rule = dispatched(_gdn.recurrent_gated_delta_rule)
recurrent_gated_delta_rule_fused_gating = dispatched(_fused.recurrent_gated_delta_rule_fused_gating)
rms_norm = dispatched(_norm.rms_norm)
write_kv_cache = dispatched(_attention.write_kv_cache)

_DISPATCHED = {name: op.torch_op for name, op in list(globals().items()) if hasattr(op, "torch_op")}


def backend_for(device) -> KernelBackend:
    """The ops an engine on `device` runs, by the default mode as it stands now."""
    return KernelBackend.for_device(device, _DISPATCHED)


__all__ = [
    "KernelBackend",
    "add_rms_norm",
    "apply_partial_rope",
    "backend_for",
    "causal_conv1d_update",
    "causal_conv1d_varlen",
    "chunk_gated_delta_rule",
    "conv_windows_at",
    "decode_kernel_serves_prefill",
    "gated_rms_norm",
    "gdn_decode",
    "get_backend",
    "naive_gated_delta_rule",
    "paged_attention",
    "qk_norm_rope",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_fused_gating",
    "rms_norm",
    "rope_cos_sin",
    "set_backend",
    "using_backend",
    "write_kv_cache",
]
