"""The SwiGLU MLP's activation, silu(gate) * up.

    reference.py   the torch form: the `torch` backend's op and the reference
    cpu.py         the native form (silu_mul.cpp; silu_mul.h, which the blocked MLP kernel of
                   kernels/linear/blocked_linear.cpp shares), eager calls only
"""

from .reference import silu_mul_torch

__all__ = ["silu_mul_torch"]
