"""Depthwise causal conv1d + SiLU of the GDN layer (no bias), with a window of past inputs.

The window holds the last K-1 PRE-conv inputs of a sequence, oldest first: exactly what the
next token's conv reads. (HF keeps K entries, of which only the newest K-1 matter.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..slot_pool import scatter_to_slots


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         initial_window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over N packed sequences, each continuing from its own window.

    x: [T, D] packed; weight: [D, K]; cu_seqlens: [N+1] int64; initial_window: [N, D, K-1] in
    x.dtype (zeros for fresh sequences; not modified).
    y[t, c] = silu(sum_j weight[c, j] * xx[c, t-K+1+j]), xx = the sequence's window ++ its inputs.
    Returns y: [T, D] in x.dtype and final_window: [N, D, K-1], the last K-1 entries of
    window ++ inputs (so a sequence shorter than K-1 keeps part of its old window).
    """
    T, D = x.shape
    W = weight.shape[1] - 1
    N = cu_seqlens.numel() - 1
    device = x.device
    if T == 0:                                          # nothing to do
        return x.new_empty(0, D), initial_window.to(x.dtype).clone()
    # One buffer holds every sequence as [window | inputs], back to back, one row per time step.
    # A token's K-tap receptive field then never leaves its own segment, so K multiply-adds over
    # shifted row ranges serve all sequences. That is F.conv1d's order of summation (bitwise
    # equal in float32) without its transposes to channels-major and back, which cost more than
    # the conv itself on CPU.
    seq_ids = torch.arange(N, device=device)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    token_row = torch.arange(T, device=device) + W * (torch.repeat_interleave(seq_ids, lengths) + 1)
    window_rows = (cu_seqlens[:-1] + W * seq_ids)[:, None] + torch.arange(W, device=device)
    buf = x.new_empty(T + N * W, D)
    buf.index_copy_(0, token_row, x)
    buf.index_copy_(0, window_rows.flatten(), initial_window.transpose(1, 2).reshape(N * W, D).to(x.dtype))

    bf, wf = buf.float(), weight.float()
    n_out = T + (N - 1) * W                                            # output j ends at buffer row j+W
    conv = bf[:n_out] * wf[:, 0]
    for j in range(1, W + 1):
        conv.addcmul_(bf[j:j + n_out], wf[:, j])
    y = F.silu(conv.to(x.dtype).index_select(0, token_row - W))
    final_window = buf[window_rows + lengths[:, None]].transpose(1, 2).contiguous()
    return y, final_window


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                         read_slots: torch.Tensor, write_slots: torch.Tensor) -> torch.Tensor:
    """Causal conv for B requests of T new tokens each (decode: T = 1; verify: k+1), batched.

    x: [B, T, D]; weight: [D, K]; window_pool: [S, D, K-1] in x.dtype, modified in place;
    read_slots: [B] int64, row b continues from window_pool[read_slots[b]]; write_slots: [B, T]
    int64, the window after token t of row b goes to window_pool[write_slots[b, t]] (entries
    < 0 skipped; tokens are written in order, so a slot repeated along t keeps the last
    window). All reads happen before any write. Returns y: [B, T, D] in x.dtype.

    The taps are summed in weight order as one multiply-add per tap over the batch (as
    F.conv1d does: bitwise equal to it in float32), because conv1d's per-call set-up costs
    more than the arithmetic at decode sizes. Accumulated in float32, rounded to x.dtype
    before the SiLU, as conv1d's output would be.
    """
    B, T, D = x.shape
    W = weight.shape[1] - 1
    xx = torch.cat([window_pool.index_select(0, read_slots).to(x.dtype), x.transpose(1, 2)], dim=-1)
    taps = xx.float().unfold(-1, T, 1).unbind(2)                        # K x [B, D, T]
    w = weight.float()[:, :, None].unbind(1)                              # K x [D, 1]
    y = taps[0] * w[0]
    for tap, w_j in zip(taps[1:], w[1:]):
        y.addcmul_(tap, w_j)
    y = F.silu(y.to(x.dtype)).transpose(1, 2)
    for t in range(T):                                 # in token order: a repeated slot keeps the last
        scatter_to_slots(window_pool, write_slots[:, t], xx[:, :, t + 1:t + 1 + W].contiguous())
    return y
