"""Gated DeltaNet ops: chunked prefill, slot-pool recurrent decode, the layer's fused decode step,
per-token reference.

    naive.py            the per-token reference of the rule
    chunk.py            the chunked prefill in torch ops (the `torch` backend's)
    recurrent.py        the decode/verify rule over slot-addressed states in torch ops
    qk_norm.py          the q/k l2 norm and scale the forms share
    decode.py           the layer's decode step from its projections (conv update, gates, rule)
                        composed of the plain ops: gdn_decode's reference
    recurrent_cpu.py    native forms (gdn_recurrent.cpp, gdn_decode.cpp; delta_rule.h shared)
    decode_cpu.py
    triton.py           triton forms (fla's chunked prefill, our recurrent kernel)
    decode_triton.py
"""

from .chunk import chunk_gated_delta_rule
from .decode import composed_gdn_decode, gdn_decode_torch
from .naive import naive_gated_delta_rule
from .recurrent import recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "composed_gdn_decode", "gdn_decode_torch", "naive_gated_delta_rule",
           "recurrent_gated_delta_rule"]
