"""The checkpoint's built-in MTP head (`mtp.*`): drafts token t+2 from h_t and token t+1.

fc([pre_fc_norm_embedding(embed(t+1)) | pre_fc_norm_hidden(h_t)]) -> one full-attention
decoder layer with its own paged KV -> norm. The embedding and lm_head are the main model's.

Under tensor parallelism (models/parallel.py) the decoder layer is split like the main model's
(its KV pool holds the rank's KV heads) and fc is whole on every rank: split, it would need one
more all-reduce (or all-gather) of its output in every draft pass, each a round trip between
the processes, to save a share of one projection's weights.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import _NormWeight
from .batch import ForwardBatch, LayerCaches
from .config import FULL, ModelConfig
from .decoder import DecoderLayer
from hybrid_engine.kernels.linear import LinearMethod

from .linear import Linear
from .mlp import make_mlp
from .parallel import SINGLE, TensorParallel


class MTPHead(nn.Module):
    def __init__(self, cfg: ModelConfig, kv_cache_index: int, method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.pre_fc_norm_embedding = _NormWeight(h)
        self.pre_fc_norm_hidden = _NormWeight(h)
        self.fc = Linear(2 * h, h, method=method)
        mlp = make_mlp(cfg, -1, method, tp)       # -1: the MTP layer (ModelConfig.layer_is_moe)
        self.layers = nn.ModuleList([DecoderLayer(cfg, FULL, kv_cache_index, mlp, method, tp)])
        self.norm = _NormWeight(h)

    def forward(self, token_embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                caches: LayerCaches, rope) -> torch.Tensor:
        """token_embeds: embeddings of token t+1 [T, H]; hidden: target h_t (final-normed) [T, H]."""
        rms_norm = batch.kernels.rms_norm
        e = rms_norm(token_embeds, self.pre_fc_norm_embedding.weight, self.eps)
        h = rms_norm(hidden, self.pre_fc_norm_hidden.weight, self.eps)
        x = self.fc(torch.cat([e, h], dim=-1))   # order matters: embedding first, then hidden
        x = self.layers[0](x, batch, caches, rope)
        return rms_norm(x, self.norm.weight, self.eps)
