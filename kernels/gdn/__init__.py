"""Gated DeltaNet ops: chunked prefill, slot-pool recurrent decode, per-token reference."""

from .chunk import chunk_gated_delta_rule
from .naive import naive_gated_delta_rule
from .recurrent import recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "naive_gated_delta_rule", "recurrent_gated_delta_rule"]
