"""Gated DeltaNet linear attention (`linear_attn`), over the GDN state-slab pools.

Prefill segments go through the chunked varlen kernels (initial state and conv window
gathered from the pool by slot, final ones scattered back), or where the step says so
(ForwardBatch.recurrent_prefill: the native CPU kernels, faster there at every length)
through the decode kernel token by token; decode segments go through the recurrent
kernels, which read the committed slot and write the state after every token to the
step's write slots (the committed slot itself for plain decode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .batch import ForwardBatch
from .config import ModelConfig
from hybrid_engine.kernels.linear import LinearMethod

from .linear import Linear
from .parallel import SINGLE, TensorParallel, shard_parameter


class GatedDeltaNet(nn.Module):
    """tp: this rank's key and value heads (models/parallel.py): q, k, v, z, b, a, the conv taps
    of each of q, k, v, A_log and dt_bias split by heads, the gated norm per head as it is;
    out_proj sums the ranks' outputs."""

    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        self.hk, self.hv = tp.heads(cfg.linear_num_key_heads), tp.heads(cfg.linear_num_value_heads)
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        sharded = tp.size > 1
        qkv = tp.by_segments((cfg.key_dim, cfg.key_dim, cfg.value_dim))
        heads = tp.by_segments((cfg.linear_num_value_heads,))
        # Qwen3.5 layout; the loader converts Qwen3-Next's grouped in_proj_qkvz / in_proj_ba to it.
        # in_proj_qkv's rows [q | k | v], head-major; z: the output gate; b, a: per value head
        self.in_proj = Linear(h, shards={"in_proj_qkv": self.conv_dim, "in_proj_z": self.value_dim,
                                         "in_proj_b": self.hv, "in_proj_a": self.hv}, method=method,
                              splits={"in_proj_qkv": qkv, "in_proj_z": tp.by_segments((cfg.value_dim,)),
                                      "in_proj_b": heads, "in_proj_a": heads} if sharded else None)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        if sharded:
            shard_parameter(self.conv1d.weight, qkv)
            shard_parameter(self.dt_bias, heads)
            shard_parameter(self.A_log, heads)
        self.norm = _PlainNormWeight(self.dv)
        self.out_proj = Linear(self.value_dim, h, method=method,
                               splits={None: tp.by_segments((cfg.value_dim,), dim=1)} if sharded else None,
                               combine=tp.all_reduce)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        """-exp(A_log) in fp32, a per-layer constant: computed at construction and after loading
        rather than in every step (so an in-place edit of A_log takes effect only through this).
        On the meta device (a model built for loading) only its shape: torch computes meta exp in
        python decompositions, which import dynamo (about 70 MiB an eager engine never uses)."""
        a_log = self.A_log.detach()
        rate = torch.empty(a_log.shape, device="meta") if a_log.is_meta else -a_log.float().exp()
        self.register_buffer("neg_decay_rate", rate, persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, conv_pool: torch.Tensor,
                state_pool: torch.Tensor, checkpoints: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """checkpoints: this layer's (conv, recurrent) checkpoint entries, where the step's
        gdn_captures go."""
        t = x.shape[0]
        # mixed: [T, conv_dim], pre-conv q|k|v; z: output gate; b, a: per value head
        in_proj = self.in_proj
        mixed, z, b, a = in_proj(x).split(in_proj.output_sizes, dim=-1)
        conv_w = self.conv1d.weight.view(self.conv_dim, self.kernel)
        p = batch.num_prefill_tokens
        if p == t:
            o = self._prefill(mixed, b, a, conv_w, batch, conv_pool, state_pool, checkpoints)
        elif p == 0:                                                  # the common step: no slicing
            o = self._decode(mixed, b, a, conv_w, batch, conv_pool, state_pool)
        else:
            o = torch.cat([self._prefill(mixed[:p], b[:p], a[:p], conv_w, batch, conv_pool, state_pool, checkpoints),
                           self._decode(mixed[p:], b[p:], a[p:], conv_w, batch, conv_pool, state_pool)])
        y = batch.kernels.gated_rms_norm(o, z.view(t, self.hv, self.dv), self.norm.weight, self.eps)  # plain weight, not 1+w
        return self.out_proj(y.view(t, self.value_dim))

    def _prefill(self, mixed, b, a, conv_w, batch: ForwardBatch, conv_pool, state_pool,
                 checkpoints) -> torch.Tensor:
        """The prefill segments (chunked varlen kernels, unless the batch has them run by the
        decode kernel) -> o [tokens, Hv, dv]. Captures: the conv window at each (the K-1 inputs
        before it) gathered here, the recurrent state written by the chunk kernel at the chunk
        boundary the layout puts there."""
        if batch.recurrent_prefill is not None:
            return self._prefill_by_decode_kernel(mixed, b, a, conv_w, batch, conv_pool, state_pool, checkpoints)
        beta = torch.sigmoid(b)                                       # activation dtype, as HF
        # Log-space decay in fp32: A_log spans log(0.01..16), fp16 would overflow exp.
        g = self.neg_decay_rate * F.softplus(a.float() + self.dt_bias.float())
        np_ = batch.num_prefills
        slots = batch.state_slots[:np_]
        fresh = ~batch.has_initial_state[:np_]
        cu = batch.cu_seqlens[:np_ + 1]
        window = conv_pool[slots]
        window[fresh] = 0
        captures = batch.gdn_captures
        capture_pool = capture_slots = None
        if captures is not None:
            ck_conv, capture_pool = checkpoints
            capture_slots = captures.entries
            ck_conv[capture_slots] = batch.kernels.conv_windows_at(mixed, cu, window, captures.seqs,
                                                                    captures.ends).to(ck_conv.dtype)
        u, final_window = batch.kernels.causal_conv1d_varlen(mixed, conv_w, cu, window)
        conv_pool[slots] = final_window
        t = u.shape[0]
        q, k, v = u.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        init = state_pool[slots]
        init[fresh] = 0
        o, final_state = batch.kernels.chunk_gated_delta_rule(q.reshape(t, self.hk, self.dk), k.reshape(t, self.hk, self.dk),
                                                v.reshape(t, self.hv, self.dv), g, beta, cu, init,
                                                layout=batch.chunks, capture_pool=capture_pool,
                                                capture_slots=capture_slots)
        state_pool[slots] = final_state
        return o

    def _prefill_by_decode_kernel(self, mixed, b, a, conv_w, batch: ForwardBatch, conv_pool, state_pool,
                                  checkpoints) -> torch.Tensor:
        """The prefill segments through the decode kernel, piece by piece (ForwardBatch.recurrent_prefill)
        -> o [tokens, Hv, dv]. After a piece that ends at a capture, the slot's conv window (the
        K-1 inputs before that position) and state are the checkpoint's."""
        rp = batch.recurrent_prefill
        if rp.fresh_slots is not None:
            conv_pool.index_fill_(0, rp.fresh_slots, 0)
            state_pool.index_fill_(0, rp.fresh_slots, 0)
        outs = []
        for piece in rp.pieces:
            rows = slice(piece.first_row, piece.first_row + piece.num_tokens)
            o = batch.kernels.gdn_decode(mixed[rows].unsqueeze(0), b[rows].unsqueeze(0), a[rows].unsqueeze(0),
                                         conv_w, self.dt_bias, self.neg_decay_rate, conv_pool, state_pool,
                                         piece.read_slots, piece.write_slots)
            outs.append(o.view(piece.num_tokens, self.hv, self.dv))
            if piece.capture is not None:
                ck_conv, ck_state = checkpoints
                entry = batch.gdn_captures.entries[piece.capture:piece.capture + 1]
                ck_conv.index_copy_(0, entry, conv_pool.index_select(0, piece.read_slots).to(ck_conv.dtype))
                ck_state.index_copy_(0, entry, state_pool.index_select(0, piece.read_slots).to(ck_state.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _decode(self, mixed, b, a, conv_w, batch: ForwardBatch, conv_pool, state_pool) -> torch.Tensor:
        """The decode segments, decode_len tokens each, from the projections: the gates, the
        conv update and the recurrent rule in one kernel op where the backend has it
        (kernels/gdn/decode.py gdn_decode) -> o [tokens, Hv, dv]."""
        nd, dl = batch.num_decodes, batch.decode_len
        read = batch.state_slots[batch.num_prefills:] if batch.num_prefills else batch.state_slots
        o = batch.kernels.gdn_decode(mixed.view(nd, dl, self.conv_dim), b.view(nd, dl, self.hv),
                                     a.view(nd, dl, self.hv), conv_w, self.dt_bias, self.neg_decay_rate,
                                     conv_pool, state_pool, read, batch.state_write_slots, rows=batch.decode_rows)
        return o.view(nd * dl, self.hv, self.dv)


class _PlainNormWeight(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
