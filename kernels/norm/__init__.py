"""Qwen3.5's RMSNorms (zero-centred, with the residual add before it, the GDN gated norm) and the
attention q/k norm + partial RoPE.

    reference.py   the torch forms: the `torch` backend's ops and every other form's reference
    cpu.py         the native forms (rms_norm.cpp), eager calls only, each falling back to the
                   reference where its kernel cannot take the call
    triton.py      the triton forms (with rope's apply_partial_rope: one kernel serves both)
"""

from .reference import add_rms_norm_torch, gated_rms_norm_torch, qk_norm_rope_torch, rms_norm_torch

__all__ = ["add_rms_norm_torch", "gated_rms_norm_torch", "qk_norm_rope_torch", "rms_norm_torch"]
