"""The GDN layer's decode and verify step from its projections with the native kernels: the conv
update (causal_conv1d_update.cpp), then gdn_decode.cpp (the q/k norm, the gates and the delta
rule), one op per layer instead of the torch form's ~30 (kernels/gdn/decode.py `gdn_decode_torch`:
the gates, the conv update, the q/k norm and the rule in sequence, the reference).

The call is the operator `hybrid_engine_cpu::gdn_decode` (kernels/native/ops.py, C++ from the checks to the
kernels); eager steps and compiled graphs call it alike. Like gdn_recurrent it takes any rows, copying
the first states of rows that depend on each other."""

from __future__ import annotations

import torch

from ..conv.cpu import DTYPES, KERNEL_SIZES, causal_conv1d_update
from ..native.ops import native_ops
from ..slot_pool import DecodeRows
from .decode import composed_gdn_decode
from .recurrent_cpu import recurrent_gated_delta_rule

MAX_DK = 512
MAX_DV = 512


def can_run_native(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                   conv_pool: torch.Tensor, state_pool: torch.Tensor) -> bool:
    """Whether the kernels serve this call: CPU tensors, activations of float32 or bf16 (b, a of
    mixed's dtype, the conv pool too, contiguous), float32 contiguous states with dv a multiple
    of 16 up to 512 and dk up to 512, a conv kernel of 2 to 4 taps, every last dim contiguous."""
    return (mixed.device.type == "cpu" and conv_weight.dtype in DTYPES
            and b.dtype == mixed.dtype and a.dtype == mixed.dtype
            and serves_layer(conv_pool, state_pool, conv_weight.shape[1], mixed.dtype)
            and mixed.shape[-1] == conv_pool.shape[1]
            and mixed.stride(-1) == 1 and b.stride(-1) == 1 and a.stride(-1) == 1)


def serves_layer(conv_pool: torch.Tensor, state_pool: torch.Tensor, conv_kernel: int, dtype: torch.dtype) -> bool:
    """The layer-wide half of `can_run_native`: whether the kernels serve a GDN layer with these
    pools (as the cache holds them), conv taps and activation dtype. Known at engine build."""
    _, hv, dk, dv = state_pool.shape
    key_dim = (conv_pool.shape[1] - hv * dv) // 2
    return (conv_pool.device.type == "cpu" and dtype in DTYPES and conv_pool.dtype == dtype
            and conv_pool.is_contiguous() and state_pool.dtype == torch.float32 and state_pool.is_contiguous()
            and dv % 16 == 0 and dv <= MAX_DV and dk <= MAX_DK and key_dim > 0 and key_dim % dk == 0
            and hv % (key_dim // dk) == 0 and conv_kernel in KERNEL_SIZES and native_available())


# (a constant to traced graphs: compiled_steps.py marks it so, where torch.compile is imported)
def native_available() -> bool:
    return native_ops() is not None


def gdn_decode_native(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                      conv_pool: torch.Tensor, dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor,
                      state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
                      scale: float, level: str | None = None) -> torch.Tensor:
    """kernels/gdn/decode.py gdn_decode's contract -> o [B, T, Hv, dv] in mixed.dtype. level: the
    kernels built for that level of kernels/native/isa.py (None: this process's; tests run each
    level below it)."""
    ops = native_ops(level)
    if ops is None:
        raise ValueError(f"gdn_decode_native: no kernel at level {level}")
    return ops.gdn_decode.default(mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate, state_pool,
                                  read_slots, write_slots, scale)


def gdn_decode_op(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, conv_weight: torch.Tensor,
                  conv_pool: torch.Tensor, dt_bias: torch.Tensor, neg_decay_rate: torch.Tensor,
                  state_pool: torch.Tensor, read_slots: torch.Tensor, write_slots: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """gdn_decode_native at this process's level, where `can_run_native` holds (the form callers
    and compiled graphs use: no lookup of the level's ops)."""
    return torch.ops.hybrid_engine_cpu.gdn_decode.default(mixed, b, a, conv_weight, conv_pool, dt_bias,
                                                          neg_decay_rate, state_pool, read_slots, write_slots,
                                                          scale)


def gdn_decode(mixed, b, a, conv_weight, dt_bias, neg_decay_rate, conv_pool, state_pool, read_slots, write_slots,
               scale=None, rows: DecodeRows | None = None):
    if (can_run_native(mixed, b, a, conv_weight, conv_pool, state_pool)
            and (rows is None or rows.independent)):
        scale = state_pool.shape[2] ** -0.5 if scale is None else scale
        return gdn_decode_op(mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate,
                             state_pool, read_slots, write_slots, scale)
    return composed_gdn_decode(causal_conv1d_update, recurrent_gated_delta_rule, mixed, b, a, conv_weight,
                               dt_bias, neg_decay_rate, conv_pool, state_pool, read_slots, write_slots,
                               scale, rows)


def decode_kernel_serves_prefill(conv_pool: torch.Tensor, state_pool: torch.Tensor, conv_kernel: int,
                                 dtype: torch.dtype) -> bool:
    """Whether prefill segments' GDN layers should run through gdn_decode token by token (their
    state written only at the end and at checkpoints): where its native kernel serves the layer.
    There it beats the chunked form at every length measured (benchmarks/history/RESULTS_LOG.md),
    with the same result to float32 rounding: the chunked form's ~40 torch ops and triangular
    solves cost more than the recurrence's one read and write of each state per token."""
    return serves_layer(conv_pool, state_pool, conv_kernel, dtype)
