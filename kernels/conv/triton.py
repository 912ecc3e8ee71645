"""Causal depthwise conv1d + SiLU on the triton backend: fla's varlen prefill, our own update.

Windows follow the torch ops' convention (kernels/conv/reference.py): the last K-1
pre-conv inputs, oldest first. fla's states hold K entries (newest last, the oldest unread),
so a zero column is prepended on the way in and dropped on the way out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton_support.common import check_private_write_slots
from .reference import conv_windows_at  # noqa: F401  (two gathers: the torch op serves)


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         initial_window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the torch op: x [T, D], weight [D, K], initial_window [N, D, K-1]."""
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    T, D = x.shape
    if T == 0:
        return x.new_empty(0, D), initial_window.to(x.dtype).clone()
    N = initial_window.shape[0]
    state = torch.cat([initial_window.new_zeros(N, D, 1), initial_window], dim=-1).to(x.dtype)
    y, final_state = fla_conv(x=x.unsqueeze(0), weight=weight.to(x.dtype), bias=None,
                              initial_state=state, output_final_state=True, activation="silu",
                              backend="triton", cu_seqlens=cu_seqlens)
    return y[0], final_state[..., 1:].contiguous()


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                         read_slots: torch.Tensor, write_slots: torch.Tensor, rows=None) -> torch.Tensor:
    """Same contract as the torch op (x [B, T, D], window_pool [S, D, K-1] updated in place; one
    form, so no DecodeRows),
    with the triton GDN decode's precondition: a row writes no other row's read slot."""
    B, T, D = x.shape
    K = weight.shape[1]
    y = torch.empty(B, T, D, dtype=x.dtype, device=x.device)
    if B == 0 or T == 0:
        return y
    check_private_write_slots(read_slots, write_slots)
    x = x if x.stride(-1) == 1 else x.contiguous()
    BD = min(triton.next_power_of_2(D), 256)
    _conv_update_kernel[(B, triton.cdiv(D, BD))](
        x, weight.contiguous(), window_pool, read_slots.contiguous(), write_slots.contiguous(), y,
        T, D, x.stride(0), x.stride(1), window_pool.stride(0), window_pool.stride(1),
        window_pool.stride(2), K=K, W=K - 1, BW=triton.next_power_of_2(max(K - 1, 1)), BD=BD)
    return y


@triton.jit
def _conv_update_kernel(x, weight, pool, read_slots, write_slots, y, T, D,
                        sx_b, sx_t, sp_s, sp_d, sp_w,
                        K: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    # Token t of row b convolves xx[t .. t+K-1] with xx = window ++ x[b]; the window after it
    # is xx[t+1 .. t+W]. The read window stays in registers, so writing the read slot is safe.
    i_b = tl.program_id(0)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask_d = offs_d < D
    cols = tl.arange(0, BW)
    read = tl.load(read_slots + i_b).to(tl.int64)
    window = tl.load(pool + read * sp_s + offs_d[:, None] * sp_d + cols[None, :] * sp_w,
                     mask=mask_d[:, None] & (cols[None, :] < W), other=0.0)
    x_row = x + i_b * sx_b + offs_d

    for t in range(T):
        acc = tl.zeros([BD], dtype=tl.float32)
        for j in tl.static_range(K):
            i = t + j
            from_window = tl.sum(tl.where(cols[None, :] == i, window, 0.0), axis=1)
            from_x = tl.load(x_row + (i - W) * sx_t, mask=mask_d & (i >= W), other=0.0)
            xx = tl.where(i < W, from_window, from_x).to(tl.float32)
            acc += xx * tl.load(weight + offs_d * K + j, mask=mask_d, other=0.0).to(tl.float32)
        out = acc * tl.sigmoid(acc)
        tl.store(y + (i_b * T + t) * D + offs_d, out.to(y.dtype.element_ty), mask=mask_d)

        write = tl.load(write_slots + i_b * T + t).to(tl.int64)
        for j in tl.static_range(W):
            i = t + 1 + j
            from_window = tl.sum(tl.where(cols[None, :] == i, window, 0.0), axis=1)
            from_x = tl.load(x_row + (i - W) * sx_t, mask=mask_d & (i >= W), other=0.0)
            xx = tl.where(i < W, from_window, from_x)
            tl.store(pool + write * sp_s + offs_d * sp_d + j * sp_w, xx.to(pool.dtype.element_ty),
                     mask=mask_d & (write >= 0))
