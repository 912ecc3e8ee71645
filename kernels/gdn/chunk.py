"""Chunked gated delta rule for prefill (packed varlen sequences), in the WY/UT form.

Same math as transformers' `torch_chunk_gated_delta_rule` and fla's chunk kernel: inside a
chunk of C tokens the C delta-rule updates collapse into one unit-lower-triangular solve, so
the only sequential part is a scan over chunks (6-8x faster than a per-token loop on CPU).

Varlen layout: every sequence is cut into chunks of its own (right-padded with k = v = beta =
g = 0, which leaves the state untouched: decay exp(0) = 1 and a zero update). Chunks are
stored step-major: all sequences' chunk 0, then all chunk 1, ... with sequences sorted by
chunk count (longest first), so step i of the scan works on one contiguous slice of chunks
and on a prefix of the sorted state batch: no gathers inside the scan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Decays at or below e^-30 (1e-13, far under float32 resolution) are set to exactly 0: products
# of such tiny factors land in float32's subnormal range, where every multiply-add is a slow
# microcode assist on x86 CPUs. With strong-decay heads that made the whole op 2-4x slower.
LOG_DECAY_CUTOFF = -30.0
CHUNK_SIZE = 64


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, cu_seqlens: torch.Tensor,
                           initial_state: torch.Tensor, scale: float | None = None,
                           use_qk_l2norm: bool = True, chunk_size: int = CHUNK_SIZE,
                           layout: ChunkLayout | None = None, capture_pool: torch.Tensor | None = None,
                           capture_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over N packed sequences.

    q, k: [T, Hk, dk]; v: [T, Hv, dv]; g (log decay, <= 0), beta: [T, Hv];
    cu_seqlens: [N+1] int64 sequence boundaries; initial_state: [N, Hv, dk, dv] float32 (zeros
    for fresh sequences; not modified). Value head h uses key head h // (Hv / Hk).
    Computes in fp32: l2norm(q), l2norm(k) (optional), q *= scale (default dk**-0.5), then per
    token S = exp(g) S; u = beta (v - S^T k); S += k u^T; o = S^T q.
    layout: the step's ChunkLayout of these sequences (built once for all GDN layers of a step,
    from lengths the caller holds; its chunk size wins); None: built here, reading the lengths back.
    capture_pool [S, Hv, dk, dv], capture_slots [layout.num_captures] int64: the state at each of
    the layout's cuts is written to capture_pool[capture_slots[c]] (captures in layout order).
    Returns o: [T, Hv, dv] in v.dtype and final_state: [N, Hv, dk, dv] float32.
    """
    T, Hv, dv = v.shape
    Hk, dk = k.shape[-2:]
    out_dtype = v.dtype
    if layout is None:
        layout = ChunkLayout((cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), chunk_size, v.device)
    chunk_size = layout.chunk_size
    if layout.num_chunks == 0:                                          # only empty sequences
        return v.new_empty(0, Hv, dv), initial_state.float().clone()
    # Every [chunks, H, C, ...] buffer below is float32 and this function's own, so the work is
    # done in place wherever it can be: each new large tensor costs a pass of page faults.
    # Heads are a batch dimension of every matmul.

    qk = torch.zeros(layout.num_chunks, Hk, 2, chunk_size, dk, device=k.device)  # [q; k] side by side
    layout.pack(q, into=qk[:, :, 0])
    layout.pack(k, into=qk[:, :, 1])
    _normalize_qk_(qk, dk ** -0.5 if scale is None else scale, use_qk_l2norm)
    if Hv > Hk:                                         # value head h reads key head h // groups
        qk = qk.repeat_interleave(Hv // Hk, dim=1)
    q, k = qk.unbind(2)
    g, beta = layout.pack(g), layout.pack(beta)                         # [chunks, Hv, C]

    # Intra-chunk part, batched over every chunk of every sequence.
    start_decay = _flushed_exp_(g.cumsum(-1))                           # decay from the chunk's start
    pair_decay = _flushed_exp_(_segment_sum(g))                        # decay from token j to i >= j
    # [q; k] k^T in one matmul: rows 0 become the causal attention inside the chunk, rows 1 the
    # UT system L = strictly_lower((k beta) k^T * pair_decay).
    scores = (qk.flatten(2, 3) @ k.transpose(-1, -2)).unflatten(2, (2, -1))
    intra_attn, ut_system = scores.unbind(2)
    ut_system.mul_(beta[..., None])
    # UT transform: u = (I + L)^-1 (v beta), w = (I + L)^-1 (k beta start_decay). With
    # L = D L0 D^-1 (D = diag(start_decay), L0 the system before decay), w = D (I + L0)^-1 (k beta):
    # solved before decay, so w is exactly 0 where start_decay is, instead of a cascade of
    # ever smaller (subnormal) values out of the decayed solve.
    w = torch.mul(k, beta[..., None])
    torch.linalg.solve_triangular(ut_system, w, upper=False, unitriangular=True, out=w)
    w.mul_(start_decay[..., None])
    scores.mul_(pair_decay[:, :, None])
    u = layout.pack(v).mul_(beta[..., None])
    torch.linalg.solve_triangular(ut_system, u, upper=False, unitriangular=True, out=u)
    q_decayed = q.mul_(start_decay[..., None])                          # reads the chunk's start state
    k_decayed = k.mul_(pair_decay[..., -1, :, None])                    # written at the chunk's end
    chunk_decay = start_decay[..., -1, None, None]

    # Inter-chunk scan: step i updates the states of the sequences that have an i-th chunk.
    # Chunks and heads merge into the batch dimension of 3-D (b)bmm's (views, no copies), and a
    # chunk's output overwrites its u once v_new has read it.
    state = initial_state.float()[layout.order]                         # a copy: indexed
    out = u
    captures = layout.captures_after_step if capture_pool is not None else {}
    for step, (start, active) in enumerate(layout.steps):
        chunks = slice(start, start + active)
        s = state[:active].flatten(0, 1)
        v_new = torch.baddbmm(u[chunks].flatten(0, 1), w[chunks].flatten(0, 1), s, alpha=-1)
        o = out[chunks].flatten(0, 1)
        torch.bmm(q_decayed[chunks].flatten(0, 1), s, out=o)
        o.baddbmm_(intra_attn[chunks].flatten(0, 1), v_new)
        s.mul_(chunk_decay[chunks].flatten(0, 1))
        s.baddbmm_(k_decayed[chunks].flatten(0, 1).transpose(-1, -2), v_new)
        if step in captures:
            ranks, ids = captures[step]
            capture_pool.index_copy_(0, capture_slots[ids], state[ranks].to(capture_pool.dtype))

    final_state = torch.empty_like(state)
    final_state[layout.order] = state
    return layout.unpack(out).to(out_dtype), final_state


def _normalize_qk_(qk: torch.Tensor, scale: float, use_qk_l2norm: bool) -> None:
    """In place on [..., 2, C, d] = [q; k]: optionally each row / sqrt(sum of squares + 1e-6)
    (eps as fla and transformers put it), then q *= scale (folded into q's row factors)."""
    if use_qk_l2norm:
        factors = qk.square().sum(-1, keepdim=True).add_(1e-6).rsqrt_()
        factors[..., 0, :, :] *= scale
        qk.mul_(factors)
    else:
        qk[..., 0, :, :] *= scale


def _flushed_exp_(log_decay: torch.Tensor) -> torch.Tensor:
    """exp in place, 0 at or below LOG_DECAY_CUTOFF (and at -inf). Clamped first: exp is several
    times slower on -inf and on arguments whose result underflows."""
    log_decay.clamp_(min=2 * LOG_DECAY_CUTOFF).exp_()
    return F.threshold_(log_decay, math.exp(LOG_DECAY_CUTOFF), 0.0)


def _segment_sum(g: torch.Tensor) -> torch.Tensor:
    """g: [..., C] -> [..., C, C] with [i, j] = sum(g[j+1 : i+1]) for j <= i, -inf above.

    Summed directly rather than as g_cum[i] - g_cum[j]: with strong decays g_cum reaches the
    hundreds within a chunk and the difference of two such numbers loses ~1e-5 relative
    precision exactly on the near-diagonal pairs that carry the weight (Mamba2's segsum).
    """
    C = g.shape[-1]
    ones = torch.ones(C, C, dtype=torch.bool, device=g.device)
    terms = g[..., :, None].expand(*g.shape, C).masked_fill(~ones.tril(-1), 0)  # [l, j] = g_l if l > j
    seg = terms.cumsum(-2)
    # -inf above the diagonal, so exp() gives 0 there and never overflows
    return seg.masked_fill_(~ones.tril(), float("-inf"))


class ChunkLayout:
    """Where each packed token of a step's prefill sequences sits in the step-major padded chunk
    buffer. Built from the sequences' lengths as host ints (the same for every GDN layer).

    cuts: per sequence, ascending offsets in (0, length] where a chunk must end: the state there
    is then a chunk-boundary state of the scan, which the kernel captures (prefix checkpoints
    inside a prefill, without splitting it). After a cut the chunks restart, so the chunks are
    exactly those of the sequence split at its cuts; the chunk before a cut may be shorter
    than chunk_size (zero padding leaves the state as it is)."""

    def __init__(self, lengths: list[int], chunk_size: int = CHUNK_SIZE, device: torch.device | str = "cpu",
                 cuts: list[list[int]] | None = None):
        self.lengths = lengths
        self.cuts = cuts if cuts is not None and any(cuts) else None
        # each sequence's chunk lengths, and the chunk index (in it) that ends at each cut
        pieces = [_chunk_lengths(n, self.cuts[i] if self.cuts else (), chunk_size) for i, n in enumerate(lengths)]
        counts = [len(chunks) for chunks, _ in pieces]
        # longest first, so the sequences alive at scan step i are a prefix of this order
        order = sorted(range(len(lengths)), key=lambda i: -counts[i])
        rank = [0] * len(order)
        for r, i in enumerate(order):
            rank[i] = r
        active = [sum(c > step for c in counts) for step in range(max(counts, default=0))]
        step_start = [sum(active[:step]) for step in range(len(active))]
        self.steps = list(zip(step_start, active))
        self.num_chunks = sum(active)
        self.chunk_size = chunk_size
        chunk, position = [], []
        for i, (chunks, _) in enumerate(pieces):
            for c, m in enumerate(chunks):
                chunk.extend([step_start[c] + rank[i]] * m)
                position.extend(range(m))
        i64 = dict(dtype=torch.int64, device=device)
        self.order = torch.tensor(order, **i64)
        self.chunk = torch.tensor(chunk, **i64)                      # [T] chunk of each token
        self.position = torch.tensor(position, **i64)                # [T] its row in the chunk
        # Captures, numbered sequence by sequence in cut order: after scan step s, the states of
        # ranks capture_ranks go to captures capture_ids (host-free: tensors built here).
        by_step: dict[int, tuple[list[int], list[int]]] = {}
        n = 0
        for i, (_, ends) in enumerate(pieces):
            for c in ends:
                ranks, ids = by_step.setdefault(c, ([], []))
                ranks.append(rank[i])
                ids.append(n)
                n += 1
        self.num_captures = n
        self.captures_after_step = {step: (torch.tensor(r, **i64), torch.tensor(ids, **i64))
                                    for step, (r, ids) in by_step.items()}

    def pack(self, x: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H, ...] -> [chunks, H, C, ...] float32, zeros in the padding; written into `into` (a
        view of zeros of that shape) when given."""
        if into is None:
            into = torch.zeros(self.num_chunks, x.shape[1], self.chunk_size, *x.shape[2:], device=x.device)
        into.transpose(1, 2)[self.chunk, self.position] = x.float()
        return into

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[chunks, H, C, ...] -> [T, H, ...]."""
        return x.transpose(1, 2)[self.chunk, self.position]


def _chunk_lengths(n: int, cuts, chunk_size: int) -> tuple[list[int], list[int]]:
    """A sequence of n tokens cut at `cuts` -> its chunk lengths and the index of the chunk
    ending at each cut."""
    chunks, ends, begin = [], [], 0
    for end in cuts:
        if not begin < end <= n:
            raise ValueError(f"cuts {list(cuts)} are not ascending offsets in (0, {n}]")
        while begin < end:
            chunks.append(min(chunk_size, end - begin))
            begin += chunks[-1]
        ends.append(len(chunks) - 1)
    while begin < n:
        chunks.append(min(chunk_size, n - begin))
        begin += chunks[-1]
    return chunks, ends
