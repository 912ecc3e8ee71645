"""Depthwise causal conv1d + SiLU of the GDN layer (no bias), with a window of past inputs.

The window holds the last K-1 PRE-conv inputs of a sequence, oldest first: exactly what the
next token's conv reads. (HF keeps K entries, of which only the newest K-1 matter.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..slot_pool import DecodeRows, scatter_to_slots


CONV_BLOCK_BYTES = 512 * 1024        # float32 bytes per block of conv rows: a few blocks fit in L2


def causal_conv1d_varlen(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor,
                         initial_window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over N packed sequences, each continuing from its own window.

    x: [T, D] packed; weight: [D, K]; cu_seqlens: [N+1] int64; initial_window: [N, D, K-1] in
    x.dtype (zeros for fresh sequences; not modified).
    y[t, c] = silu(sum_j weight[c, j] * xx[c, t-K+1+j]), xx = the sequence's window ++ its inputs.
    Returns y: [T, D] in x.dtype and final_window: [N, D, K-1], the last K-1 entries of
    window ++ inputs (so a sequence shorter than K-1 keeps part of its old window).

    The taps are summed in weight order in float32, one multiply-add per tap over shifted row
    ranges (F.conv1d's order of summation: bitwise equal to it in float32, without its
    transposes to channels-major and back), rounded to x.dtype before the SiLU.
    """
    T, D = x.shape
    W = weight.shape[1] - 1
    if T == 0:                                          # nothing to do
        return x.new_empty(0, D), initial_window.to(x.dtype).clone()
    taps = weight.float().t().contiguous()                              # [K, D]
    y = x.new_empty(T, D)
    # Every row t >= W as if the packed tokens were one stream, in blocks of rows small enough
    # to stay in cache through the K multiply-adds and the SiLU: over whole [T, D] tensors each
    # pass would stream from memory, and each temporary would be a fresh allocation to page in.
    block = max(1, CONV_BLOCK_BYTES // (4 * D))
    acc = None if x.dtype == torch.float32 else x.new_empty(block, D, dtype=torch.float32)
    for start in range(W, T, block):
        stop = min(start + block, T)
        _conv_silu_rows(x[start - W:stop], taps, y[start:stop], acc)
    # The first W rows of each sequence read its window (the pass above got them wrong or never
    # computed them): recompute them from [window | first W inputs], all sequences at once.
    starts, lengths = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
    pos = torch.arange(W, device=x.device)
    firsts = torch.cat([initial_window.transpose(1, 2).to(x.dtype),
                        x[(starts[:, None] + pos).clamp(max=T - 1)]], dim=1)   # [N, 2W, D]
    first_y = x.new_empty(len(starts), W, D)
    _conv_silu_rows(firsts, taps, first_y, None)
    is_first = pos < lengths[:, None]
    y[(starts[:, None] + pos)[is_first]] = first_y[is_first]
    # final window: the last W inputs, or for a sequence shorter than W part of its old window
    from_inputs = x[((starts + lengths - W)[:, None] + pos).clamp(0, T - 1)]
    from_firsts = firsts.gather(1, (lengths[:, None] + pos).clamp(max=2 * W - 1)[..., None].expand(-1, -1, D))
    final_window = torch.where((lengths >= W)[:, None, None], from_inputs, from_firsts)
    return y, final_window.transpose(1, 2).contiguous()


def conv_windows_at(x: torch.Tensor, cu_seqlens: torch.Tensor, initial_window: torch.Tensor,
                    seqs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """The conv windows inside packed sequences (prefix checkpoints within a prefill).

    x: [T, D] packed pre-conv inputs; cu_seqlens: [N+1]; initial_window: [N, D, K-1];
    seqs, ends: [C] int64: window c is the one after packed row ends[c] - 1 of sequence seqs[c],
    the last K-1 inputs before row ends[c], reaching into the sequence's initial window where
    fewer of its own inputs precede. Returns [C, D, K-1] in x.dtype. Two gathers, no host reads.
    """
    N, D, W = initial_window.shape
    rows = ends[:, None] + torch.arange(-W, 0, device=x.device)                  # [C, W]
    into_window = rows - cu_seqlens[seqs][:, None]                                # < 0: before the sequence
    from_window = initial_window.transpose(1, 2)[seqs[:, None], (into_window + W).clamp(0, W - 1)]
    from_inputs = x[rows.clamp(min=0)]
    return torch.where((into_window < 0)[..., None], from_window.to(x.dtype), from_inputs).transpose(1, 2)


def _conv_silu_rows(x: torch.Tensor, taps: torch.Tensor, out: torch.Tensor,
                    acc: torch.Tensor | None) -> None:
    """out[..., i, :] = silu(sum_j taps[j] * x[..., i + j, :]); x: [..., R + K - 1, D], out: [..., R, D].

    Sums in float32: in `out` when it is float32, else in acc[:R] (a reused float32 [>= R, D]
    buffer) or, without acc, in a new tensor.
    """
    R = out.shape[-2]
    xf = x.float()
    if out.dtype == torch.float32:
        acc = out
    elif acc is not None:
        acc = acc[:R]
    else:
        acc = torch.empty(out.shape, device=out.device)
    torch.mul(xf[..., :R, :], taps[0], out=acc)
    for j in range(1, taps.shape[0]):
        acc.addcmul_(xf[..., j:j + R, :], taps[j])
    if acc is not out:
        out.copy_(acc)
    F.silu(out, inplace=True)


def causal_conv1d_update_torch(x: torch.Tensor, weight: torch.Tensor, window_pool: torch.Tensor,
                               read_slots: torch.Tensor, write_slots: torch.Tensor,
                               rows: DecodeRows | None = None) -> torch.Tensor:
    """Causal conv for B requests of T new tokens each (decode: T = 1; verify: k+1), batched.

    x: [B, T, D]; weight: [D, K]; window_pool: [S, D, K-1] in x.dtype, modified in place;
    read_slots: [B] int64, row b continues from window_pool[read_slots[b]]; write_slots: [B, T]
    int64, the window after token t of row b goes to window_pool[write_slots[b, t]] (entries
    < 0 skipped; tokens are written in order, so a slot repeated along t keeps the last
    window). All reads happen before any write. rows: the step's DecodeRows (None: read back
    from the slots). Returns y: [B, T, D] in x.dtype. (The cpu backend's native form:
    kernels/conv/causal_conv1d_update.cpp, the same numerics.)

    Each output is one product of its K-tap window with the weight and a sum over the taps
    (conv1d's per-call set-up costs more than the arithmetic at decode sizes; this is two
    ops for any B and T). The sum's order differs from F.conv1d's by an ulp at most, and does
    not depend on B or T, so a token gets the same output in a decode and in a verify step.
    Accumulated in float32, rounded to x.dtype before the SiLU, as conv1d's output would be.
    """
    B, T, D = x.shape
    W = weight.shape[1] - 1
    xx = torch.cat([window_pool.index_select(0, read_slots), x.transpose(1, 2)], dim=-1)  # [B, D, W + T]
    y = (xx.float().unfold(-1, W + 1, 1) * weight.float()[:, None]).sum(-1)  # [B, D, T]
    y = F.silu(y.to(x.dtype)).transpose(1, 2)
    windows = xx.unfold(-1, W, 1).unbind(2)[1:]        # T x [B, D, W]: the window after each token
    valid = (rows or DecodeRows.of_tensors(read_slots, write_slots)).writes_valid
    for slots, window in zip(write_slots.unbind(1), windows):   # in token order: a repeated slot keeps the last
        scatter_to_slots(window_pool, slots, window, valid)
    return y
