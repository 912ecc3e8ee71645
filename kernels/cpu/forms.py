"""The `cpu` backend's forms of the ops: each op's native kernel where it takes the call, else
the op's torch reference (kernels/norm.py, fused.py, attention.py, conv/, gdn/, activation.py),
which never calls native code itself.

Which form runs is decided here, once per call from facts the caller already holds (dtypes,
shapes, the step's DecodeRows and AttentionLayout computed once by the engine's builder), and
by the same predicates the engine asks at build time (kernels/backends.py `CpuBackend`), so no
caller predicts what a kernel will do.

The norms and the SwiGLU activation are native in eager calls only: a step torch.compile traces
keeps their torch forms, which inductor fuses into its own loops. The conv update, the GDN
recurrence, the GDN decode step and decode attention are native in compiled graphs too (one
extern call each).
"""

from __future__ import annotations

import torch

from .. import activation, attention, conv, fused, norm
from ..gdn import recurrent
from ..gdn.qk_norm import normalize_kq
from ..slot_pool import DecodeRows
from . import causal_conv1d_update as native_conv
from . import gdn_decode as native_gdn_decode
from . import gdn_recurrent as native_recurrent
from . import paged_attention as native_attention
from . import rms_norm as native_norm
from . import silu_mul as native_silu_mul

# Steps with at most this many new tokens per sequence (decode, verify) read the cache in place
# where the native kernel runs; longer ones (prefills) keep the gather and sdpa, whose matrix
# products serve many queries better than the kernel's row-at-a-time loop.
NATIVE_MAX_QUERY_LEN = 16


def rms_norm(x, weight, eps):
    if native_norm.can_run_native(x, weight):
        return native_norm.rms_norm_native(x, weight, eps)
    return norm.rms_norm_torch(x, weight, eps)


def add_rms_norm(x, h, weight, eps):
    if h.shape == x.shape and h.dtype == x.dtype and native_norm.can_run_native(x, weight):
        return native_norm.add_rms_norm_native(x, h, weight, eps)
    return norm.add_rms_norm_torch(x, h, weight, eps)


def gated_rms_norm(x, z, weight, eps):
    if z.shape == x.shape and z.dtype == x.dtype and native_norm.can_run_native(x, weight):
        return native_norm.gated_rms_norm_native(x, z, weight, eps)
    return norm.gated_rms_norm_torch(x, z, weight, eps)


def qk_norm_rope(q, k, q_weight, k_weight, eps, cos, sin):
    if native_norm.can_run_qk_norm_rope(q, k, q_weight, k_weight, cos, sin):
        return native_norm.qk_norm_rope_native(q, k, q_weight, k_weight, eps, cos, sin)
    return fused.qk_norm_rope_torch(q, k, q_weight, k_weight, eps, cos, sin)


def silu_mul(x):
    if native_silu_mul.can_run_native(x):
        return native_silu_mul.silu_mul_native(x)
    return activation.silu_mul_torch(x)


def causal_conv1d_update(x, weight, window_pool, read_slots, write_slots, rows: DecodeRows | None = None):
    if native_conv.can_run_native(x, weight, window_pool):    # any slots: the kernel reads all first too
        return native_conv.conv_update_op(x, weight, window_pool, read_slots, write_slots)
    return conv.causal_conv1d_update_torch(x, weight, window_pool, read_slots, write_slots, rows)


def recurrent_gated_delta_rule(q, k, v, g, beta, state_pool, read_slots, write_slots, scale=None,
                               use_qk_l2norm=True, rows: DecodeRows | None = None):
    if native_recurrent.can_run_native(state_pool) and (rows is None or rows.independent):
        # Without the step's rows the op checks them itself, at run time, and copies the states
        # of rows that depend on each other first.
        kq = normalize_kq(q, k, v.shape[2], scale, use_qk_l2norm)        # [B, T, Hv, 2, dk]
        o = native_recurrent.gdn_recurrent_native(kq, g.float().exp(), beta, v, state_pool, read_slots, write_slots)
        return o.to(v.dtype)
    return recurrent.recurrent_gated_delta_rule(q, k, v, g, beta, state_pool, read_slots, write_slots, scale,
                                                use_qk_l2norm, rows)


def gdn_decode(mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_pool, state_pool, read_slots, write_slots,
               scale=None, rows: DecodeRows | None = None):
    if (native_gdn_decode.can_run_native(mixed, b, a, conv_weight, conv_pool, state_pool)
            and (rows is None or rows.independent)):
        scale = state_pool.shape[2] ** -0.5 if scale is None else scale
        return native_gdn_decode.gdn_decode_op(mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate,
                                               state_pool, read_slots, write_slots, scale)
    return fused.composed_gdn_decode(causal_conv1d_update, recurrent_gated_delta_rule, mixed, b, a, conv_weight,
                                     dt_bias, neg_decay_rate, conv_pool, state_pool, read_slots, write_slots,
                                     scale, rows)


def reads_cache_in_place(kv_cache: torch.Tensor, num_heads: int, query_len: int) -> bool:
    """Whether decode attention of `query_len` new tokens per sequence runs the native kernel,
    which reads K and V in place through the block tables (so the step needs no PagedKeys)."""
    return 0 < query_len <= NATIVE_MAX_QUERY_LEN and native_attention.can_run_native(kv_cache, num_heads, query_len)


def paged_attention(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, layout=None):
    query_len = layout.query_len if layout is not None else 0    # 0: lengths differ, or not known
    if q.shape[0] and reads_cache_in_place(kv_cache, q.shape[1], query_len):
        return native_attention.paged_attention_op(q, kv_cache, block_tables, seq_lens, scale).to(q.dtype)
    return attention.paged_attention(q, kv_cache, block_tables, cu_seqlens_q, seq_lens, scale, layout)


def decode_kernel_serves_prefill(conv_pool: torch.Tensor, state_pool: torch.Tensor, conv_kernel: int,
                                 dtype: torch.dtype) -> bool:
    """Whether prefill segments' GDN layers should run through gdn_decode token by token (their
    state written only at the end and at checkpoints): where its native kernel serves the layer.
    There it beats the chunked form at every length measured (benchmarks/history/RESULTS_LOG.md),
    with the same result to float32 rounding: the chunked form's ~40 torch ops and triangular
    solves cost more than the recurrence's two passes over each state per token."""
    return native_gdn_decode.serves_layer(conv_pool, state_pool, conv_kernel, dtype)
