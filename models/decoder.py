"""The decoder layer and the layer-type dispatcher."""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.kernels.linear import LinearMethod

from .attention import GatedAttention, _NormWeight
from .batch import ForwardBatch, LayerCaches
from .config import FULL, LINEAR, ModelConfig
from .gdn import GatedDeltaNet
from .parallel import SINGLE, TensorParallel


class DecoderLayer(nn.Module):
    """Pre-norm residual block: token mixer (GDN or gated attention), then MLP or MoE.

    `cache_index` is the layer's ordinal among layers of its own kind: it picks the KV
    pool (attention) or the conv/recurrent pools (GDN) out of LayerCaches.
    """

    def __init__(self, cfg: ModelConfig, layer_type: str, cache_index: int, mlp: nn.Module,
                 method: LinearMethod | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_type = layer_type
        self.cache_index = cache_index
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = _NormWeight(cfg.hidden_size)
        self.post_attention_layernorm = _NormWeight(cfg.hidden_size)
        if layer_type == FULL:
            self.self_attn = GatedAttention(cfg, method, tp)
        elif layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, method, tp)
        else:
            raise ValueError(f"unknown layer type {layer_type!r}")
        self.mlp = mlp

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: LayerCaches,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        ops = batch.kernels
        h = ops.rms_norm(x, self.input_layernorm.weight, self.eps)
        if self.layer_type == FULL:
            h = self.self_attn(h, batch, caches.kv_caches[self.cache_index], rope)
        else:
            i = self.cache_index
            checkpoints = ((caches.checkpoint_conv_states[i], caches.checkpoint_recurrent_states[i])
                           if batch.gdn_captures is not None else None)
            h = self.linear_attn(h, batch, caches.conv_states[i], caches.recurrent_states[i], checkpoints)
        x, h = ops.add_rms_norm(x, h, self.post_attention_layernorm.weight, self.eps)   # x + h, its norm
        return x + self.mlp(h, ops)   # ops: the backend's, for the activation
