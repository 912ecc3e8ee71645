"""Gated full attention (Qwen3.5 / Qwen3-Next `self_attn`), over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from .batch import ForwardBatch
from .config import ModelConfig
from hybrid_engine.kernels.linear import LinearMethod

from .linear import Linear
from .parallel import SINGLE, TensorParallel


class GatedAttention(nn.Module):
    """tp: this rank's heads (models/parallel.py); o_proj sums the ranks' outputs."""

    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.num_heads = tp.heads(cfg.num_attention_heads)
        self.num_kv_heads = tp.heads(cfg.num_key_value_heads)
        self.head_dim = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim ** -0.5
        h, hd = cfg.hidden_size, cfg.head_dim
        # q_proj is doubled: per head, hd query rows then hd output-gate rows (interleaved per head).
        self.qkv_proj = Linear(h, shards={"q_proj": self.num_heads * hd * 2, "k_proj": self.num_kv_heads * hd,
                                          "v_proj": self.num_kv_heads * hd}, method=method,
                               splits=_head_splits(cfg, tp) if tp.size > 1 else None)
        self.o_proj = Linear(self.num_heads * hd, h, method=method,
                             splits={None: tp.by_heads(cfg.num_attention_heads, hd, dim=1)} if tp.size > 1 else None,
                             combine=tp.all_reduce)
        self.q_norm = _NormWeight(hd)
        self.k_norm = _NormWeight(hd)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, kv_cache: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj
        q_gate, k, v = qkv(x).split(qkv.output_sizes, dim=-1)
        q, gate = q_gate.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        # q/k norms are zero-centred RMSNorms over head_dim, applied before RoPE.
        ops = batch.kernels
        q, k = ops.qk_norm_rope(q, k.view(t, self.num_kv_heads, self.head_dim), self.q_norm.weight,
                            self.k_norm.weight, self.eps, *rope)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        ops.write_kv_cache(k, v, kv_cache, batch.slot_mapping, batch.attention.slots_valid)
        o = ops.paged_attention(q, kv_cache, batch.block_tables, batch.cu_seqlens, batch.seq_lens, self.scale,
                            batch.attention)
        # The gate is per head and per dim, in the same (head, dim) order as the output.
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(t, -1))


def _head_splits(cfg: ModelConfig, tp: TensorParallel) -> dict:
    hd = cfg.head_dim
    return {"q_proj": tp.by_heads(cfg.num_attention_heads, 2 * hd), "k_proj": tp.by_heads(cfg.num_key_value_heads, hd),
            "v_proj": tp.by_heads(cfg.num_key_value_heads, hd)}


class _NormWeight(nn.Module):
    """Holds a norm weight under `<name>.weight`, as checkpoints name it."""

    def __init__(self, dim: int, init: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), init))
