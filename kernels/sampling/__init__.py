"""Sampling-side ops: a structured output's token mask applied to logits rows.

    reference.py         the torch form: the reference and the fallback
    cpu.py               the native form (token_bitmask.cpp), eager calls only
"""

from .reference import apply_token_bitmask_torch

__all__ = ["apply_token_bitmask_torch"]
