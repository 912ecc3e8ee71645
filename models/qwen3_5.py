"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid causal LM (one class for all three).

The model owns no cache memory and knows nothing about requests: a step's ForwardBatch and
the cache pools are passed in, hidden states come out.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.kernels import rope_cos_sin

from .attention import _NormWeight
from .batch import ForwardBatch, LayerCaches
from .config import FULL, ModelConfig
from .decoder import DecoderLayer
from hybrid_engine.kernels.cpu.projection import PlainProjection, Projection, choose_projection

from .linear import linear, prepare_projections
from .mlp import make_mlp
from .mtp import MTPHead


class HybridForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool = False):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        layers, counts = [], {"full_attention": 0, "linear_attention": 0}
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, kind, counts[kind], make_mlp(cfg, i)))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = _NormWeight(cfg.hidden_size)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # The MTP layer's KV pool comes right after the main model's attention pools.
        self.mtp = MTPHead(cfg, kv_cache_index=counts[FULL]) if with_mtp else None
        # lm_head's projection (kernels/cpu/projection.py), chosen by pack_weights
        self.lm_head_projection: Projection | None = None

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.full_attention_layers) + (1 if self.mtp is not None else 0)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens.weight.is_meta:      # tied, and lm_head's projection holds the table
            return self.lm_head_projection.rows(token_ids)
        return self.embed_tokens(token_ids)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        return rope_cos_sin(positions, self.cfg.rotary_dim, self.cfg.rope_theta, dtype)

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: LayerCaches) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, H] (what lm_head and the MTP head read)."""
        x = self.embed(input_ids)
        rope = self.rope(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, batch, caches, rope)
        return batch.kernels.rms_norm(x, self.norm.weight, self.cfg.rms_norm_eps)

    def forward_step(self, input_ids: torch.Tensor, batch: ForwardBatch, caches: LayerCaches
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, then lm_head on the batch's logits_indices rows only -> (final-normed hidden
        [T, H], float32 logits [rows, vocab])."""
        hidden = self(input_ids, batch, caches)
        return hidden, self.compute_logits(hidden[batch.logits_indices]).float()

    def mtp_forward(self, tokens: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch,
                    caches: LayerCaches, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """One MTP pass (models/mtp.py): tokens [T] (token t+1), hidden [T, H] (the target's
        final-normed h_t) -> the MTP layer's final-normed hidden [T, H]. rope: the cos, sin
        tables of batch.positions in the embeddings' dtype where the caller made them already
        (the draft passes make all of theirs at once)."""
        embeds = self.embed(tokens)
        if rope is None:
            rope = self.rope(batch.positions, embeds.dtype)
        return self.mtp(embeds, hidden.to(embeds.dtype), batch, caches, rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight() if self.lm_head_projection is None else self.lm_head_projection
        return linear(hidden, weight)

    def pack_weights(self, onednn: bool = True, few_rows_copy: bool = True) -> None:
        """Gives each projection the layout kernels/cpu chooses for it (kernels/cpu/projection.py;
        onednn and few_rows_copy as `choose_projection` takes them; on CPU only). Inference only:
        afterwards state_dict lacks the replaced weights. lm_head gets a projection of its own;
        where it holds the weights in a layout of its own (`replaces_weight`), the plain weight
        is freed and a tied embedding reads its rows from the projection, otherwise the plain
        table stays (a tied embedding lookup needs it: vocab x hidden more memory, for the
        largest matmul of every step)."""
        replaced = False
        for module in self.modules():
            replaced |= prepare_projections(module, getattr(module, "PACKED_WEIGHTS", []), onednn, few_rows_copy)
        if self.lm_head_projection is None:
            weight = self.lm_head_weight()
            projection = choose_projection(weight, onednn, few_rows_copy)
            if not isinstance(projection, PlainProjection):
                self.lm_head_projection = projection
                replaced = True
            if projection.replaces_weight:
                owner = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
                owner.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                            requires_grad=False)
        if replaced:
            _unpin_shared_storages(self)


def _unpin_shared_storages(model: nn.Module) -> None:
    """Gives each tensor left after preparing the projections (norms, conv taps, gate biases,
    small projections, experts) memory of its own. Tensors read from a safetensors file hold on
    to its memory map, so any one of them keeps the whole file resident once the projections
    have been copied into layouts of their own (float32 0.8B: 3 GB more resident memory).
    (Called only when some were: otherwise the file's pages are the weights.)"""
    tensors = [(m, n, t) for m in model.modules()
               for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
               if not t.is_meta]
    for module, name, t in tensors:
        if t.dim() > 2 and t.numel() * t.element_size() >= 1 << 20:
            continue                                # experts: left on the file's pages
        copy = t.detach().clone()
        if isinstance(t, nn.Parameter):
            setattr(module, name, nn.Parameter(copy, requires_grad=t.requires_grad))
        else:
            module.register_buffer(name, copy, persistent=name not in module._non_persistent_buffers_set)
