"""Short causal depthwise conv of the GDN layer: varlen prefill and slot-pool update.

    reference.py   the torch forms: the `torch` backend's ops and the reference
    cpu.py         the native decode/verify update (causal_conv1d_update.cpp)
    triton.py      the triton forms (fla's varlen prefill, our own update)
"""

from .reference import causal_conv1d_update_torch, causal_conv1d_varlen, conv_windows_at

__all__ = ["causal_conv1d_update_torch", "causal_conv1d_varlen", "conv_windows_at"]
