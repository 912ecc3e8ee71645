"""The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next hybrid causal LM (one class for all three).

The model owns no cache memory and knows nothing about requests: a step's ForwardBatch and
the cache pools are passed in, hidden states come out.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.kernels import rope_cos_sin
from hybrid_engine.kernels.linear import LinearMethod

from .attention import _NormWeight
from .batch import ForwardBatch, LayerCaches
from .config import FULL, ModelConfig
from .decoder import DecoderLayer
from .linear import Linear
from .mlp import make_mlp
from .mtp import MTPHead
from .parallel import SINGLE, TensorParallel, shard_parameter


class HybridForCausalLM(nn.Module):
    """method: the linear method of every projection (kernels/linear/reference.py; None: the plain one),
    which owns their weights' layouts. With tied embeddings lm_head is loaded with the embedding
    table (models/load.py); where its method then holds the values in a layout of its own, the
    plain table is freed and the embedding reads its rows from lm_head.

    tp: this rank's part of a tensor-parallel model (models/parallel.py): its heads and MLP rows
    in each layer, and 1/N of the vocabulary rows of lm_head (the logits gathered on rank 0) and
    of the embedding (each rank looks up the ids it holds, zeros elsewhere, and the rows are
    summed across ranks: one all-reduce per forward, against V x H x (N-1)/N bytes a rank would
    hold otherwise, the size of a decoder layer or more)."""

    def __init__(self, cfg: ModelConfig, with_mtp: bool = False, method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # Left uninitialised like every weight here (the loader assigns them): nn.Embedding's own
        # init of a meta table runs through torch's python decompositions, which import dynamo
        # (about 70 MiB resident that an eager engine never uses).
        vocab = tp.by_segments((cfg.vocab_size,))
        self.embed_tokens = nn.Embedding(vocab.local_size(), cfg.hidden_size,
                                         _weight=torch.empty(vocab.local_size(), cfg.hidden_size))
        if tp.size > 1:
            shard_parameter(self.embed_tokens.weight, vocab)
            self._first_id = vocab.index * vocab.local_size()
        layers, counts = [], {"full_attention": 0, "linear_attention": 0}
        for i, kind in enumerate(cfg.layer_types):
            layers.append(DecoderLayer(cfg, kind, counts[kind], make_mlp(cfg, i, method, tp), method, tp))
            counts[kind] += 1
        self.layers = nn.ModuleList(layers)
        self.norm = _NormWeight(cfg.hidden_size)
        self.lm_head = Linear(cfg.hidden_size, vocab.local_size(), method=method,
                              splits={None: vocab} if tp.size > 1 else None, combine=_gathered_logits(tp, cfg.vocab_size))
        # The MTP layer's KV pool comes right after the main model's attention pools.
        self.mtp = MTPHead(cfg, kv_cache_index=counts[FULL], method=method, tp=tp) if with_mtp else None

    @property
    def num_kv_layers(self) -> int:
        return len(self.cfg.full_attention_layers) + (1 if self.mtp is not None else 0)

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1:
            local = token_ids - self._first_id
            held = (local >= 0) & (local < self.embed_tokens.num_embeddings)
            rows = self.embed_tokens(torch.where(held, local, 0)) * held.unsqueeze(-1).to(self.embed_tokens.weight.dtype)
            return self.tp.all_reduce(rows)
        if self.embed_tokens.weight.is_meta:      # tied, and lm_head's method holds the table
            return self.lm_head.rows(token_ids)
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
        return self.lm_head(hidden)

    def process_weights_after_loading(self, layers: list[nn.Module]) -> None:
        """Once, after loading: each of `layers` (the modules models/load.py did not process as
        their last tensor arrived) derives what it keeps from its weights (projections their
        method's layout, GDN its decay rate); then no tensor left keeps the checkpoint file's
        memory map resident."""
        for module in layers:
            module.process_weights_after_loading()
        _unpin_shared_storages(self)

    def tie_lm_head(self, table: torch.Tensor) -> None:
        """With tied embeddings, once the checkpoint's table is loaded: lm_head takes it (its part
        of it under tensor parallelism) and processes it, and where lm_head's method then holds
        the values in a layout of its own the plain table is freed at once (the embedding reads
        its rows from lm_head): loading never holds a quantized model beside the float table,
        the largest tensor of a small model. (Under tensor parallelism each rank's embedding keeps
        its own part of the table.) `serves_rows` tells lm_head's method that the embedding will
        read rows from it, which it may then hold apart from the product's (rows_bits)."""
        self.lm_head.serves_rows = not self.lm_head.splits
        self.lm_head.weight_loader("lm_head.weight", table)
        self.lm_head.process_weights_after_loading()
        if self.lm_head.serves_rows and self.lm_head.method.holds_weight_elsewhere(self.lm_head):
            table = self.embed_tokens.weight
            self.embed_tokens.weight = nn.Parameter(torch.empty(table.shape, dtype=table.dtype, device="meta"),
                                                    requires_grad=False)


def _gathered_logits(tp: TensorParallel, vocab_size: int):
    """lm_head's combine under tensor parallelism: the ranks' vocabulary parts gathered, less
    the last part's padding rows."""
    if tp.gather_logits is None:
        return None
    return lambda part: tp.gather_logits(part)[..., :vocab_size]


def _unpin_shared_storages(model: nn.Module) -> None:
    """Gives each tensor left after processing the weights (norms, conv taps, gate biases,
    projections kept plain, experts) memory of its own. Tensors read from a safetensors file hold
    on to its memory map, so any one of them keeps the whole file resident once other weights
    have been copied into layouts or merged projections of their own (float32 0.8B: 3 GB more
    resident memory)."""
    tensors = [(m, n, t) for m in model.modules()
               for n, t in list(m.named_parameters(recurse=False)) + list(m.named_buffers(recurse=False))
               if not t.is_meta]
    seen: dict[tuple, torch.Tensor] = {}            # tensors shared by two modules stay shared
    for module, name, t in tensors:
        if t.dim() > 2 and t.numel() * t.element_size() >= 1 << 20:
            continue                                # experts: left on the file's pages
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        copy = seen.get(key)
        if copy is None:
            copy = seen[key] = t.detach().clone()
        if isinstance(t, nn.Parameter):
            setattr(module, name, nn.Parameter(copy, requires_grad=t.requires_grad))
        else:
            module.register_buffer(name, copy, persistent=name not in module._non_persistent_buffers_set)
