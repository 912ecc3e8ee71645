"""Partial NeoX-style rotary embedding.

    reference.py   the cos/sin tables and the rotation in torch ops: the `torch` backend's op; the
                   triton form shares the q/k norm's kernel (kernels/norm/triton.py), and the
                   native one is fused into the q/k norm (kernels/norm/rms_norm.cpp)
"""

from .reference import apply_partial_rope, rope_cos_sin

__all__ = ["apply_partial_rope", "rope_cos_sin"]
