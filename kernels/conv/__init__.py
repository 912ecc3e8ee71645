"""Short causal depthwise conv of the GDN layer: varlen prefill and slot-pool update."""

from .causal_conv1d import causal_conv1d_update_torch, causal_conv1d_varlen, conv_windows_at

__all__ = ["causal_conv1d_update_torch", "causal_conv1d_varlen", "conv_windows_at"]
