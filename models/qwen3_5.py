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
from .linear import (add_few_rows_twin, add_plain_few_rows_twin, can_pack, linear, pack_weight, pack_weights,
                     worth_blocking)
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
        self.packed_lm_head: torch.Tensor | None = None

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.full_attention_layers) + (1 if self.mtp is not None else 0)

    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens.weight.is_meta:      # tied and blocked: rows from lm_head's blocks
            head = self.packed_lm_head
            return head[token_ids // head.shape[-1], :, token_ids % head.shape[-1]]
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
                    caches: LayerCaches) -> torch.Tensor:
        """One MTP pass (models/mtp.py): tokens [T] (token t+1), hidden [T, H] (the target's
        final-normed h_t) -> the MTP layer's final-normed hidden [T, H]."""
        embeds = self.embed(tokens)
        rope = self.rope(batch.positions, embeds.dtype)
        return self.mtp(embeds, hidden.to(embeds.dtype), batch, caches, rope)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.lm_head_weight() if self.packed_lm_head is None else self.packed_lm_head
        return linear(hidden, weight)

    def pack_weights(self, onednn: bool = True, few_rows_copy: bool = True) -> None:
        """Puts the projection weights in the layout their products run fastest from where that
        pays (models/linear.py: CPU; float32 blocked for the native kernel, bfloat16 / float16
        reordered for oneDNN unless onednn=False, with a blocked copy for few rows unless
        few_rows_copy=False; a no-op otherwise). Inference only: afterwards
        state_dict holds blocked, opaque or meta tensors. lm_head gets a packed copy; a oneDNN one
        sits beside the plain weight (a tied embedding lookup needs the plain table: vocab x
        hidden more memory, for the largest matmul of every step), a blocked one replaces it."""
        for module in self.modules():
            pack_weights(module, getattr(module, "PACKED_WEIGHTS", []), onednn, few_rows_copy)
        weight = self.lm_head_weight()
        if self.packed_lm_head is None and few_rows_copy:
            add_plain_few_rows_twin(weight, onednn)
        if self.packed_lm_head is None and can_pack(weight, onednn):
            self.packed_lm_head = pack_weight(weight)
            if few_rows_copy:
                add_few_rows_twin(self.packed_lm_head, weight)
            if self.packed_lm_head.dim() == 3:
                # Blocked rows are still rows: a tied embedding gathers from the blocks (a few
                # strided reads per token; `embed`), so the plain table is freed, not kept.
                owner = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
                owner.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                            requires_grad=False)
        _unpin_shared_storages(self)


def _unpin_shared_storages(model: nn.Module) -> None:
    """Gives each plain tensor left after packing (norms, conv taps, gate biases, small
    projections) memory of its own. Tensors read from a safetensors file hold on to its memory
    map, so any one of them keeps the whole file resident once the projections have been copied
    into packed layouts (float32 0.8B: 3 GB more resident memory). Nothing to do when nothing
    was packed: then the file's pages are the weights."""
    tensors = [(m, n, t) for m in model.modules()
               for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
               if not t.is_meta]
    if model.packed_lm_head is None and not any(t.is_mkldnn for _, _, t in tensors):
        return
    for module, name, t in tensors:
        if t.is_mkldnn or (t.dim() > 2 and worth_blocking(t)):
            continue                                # packed or blocked (copies already), or experts
        copy = t.detach().clone()
        if hasattr(t, "few_rows"):
            copy.few_rows = t.few_rows              # a plain bf16 weight's blocked copy (linear.py)
        if isinstance(t, nn.Parameter):
            setattr(module, name, nn.Parameter(copy, requires_grad=t.requires_grad))
        else:
            module.register_buffer(name, copy, persistent=name not in module._non_persistent_buffers_set)
