"""Feed-forward blocks: dense SwiGLU and the sparse MoE with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from hybrid_engine.kernels.linear import LinearMethod

from .linear import Linear
from .parallel import SINGLE, TensorParallel, shard_parameter


class SwiGLU(nn.Module):
    """tp: gate and up rows split over the ranks, down_proj's matching columns; its output is
    this rank's partial sum (ParallelSwiGLU sums the ranks'; the MoE's shared expert leaves it
    for the block's one sum)."""

    def __init__(self, hidden: int, intermediate: int, method: LinearMethod | None = None,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        split = tp.by_segments((intermediate,))
        local = split.local_size()
        self.gate_up_proj = Linear(hidden, shards={"gate_proj": local, "up_proj": local}, method=method,
                                   splits={"gate_proj": split, "up_proj": split} if tp.size > 1 else None)
        self.down_proj = Linear(local, hidden, method=method,
                                splits={None: tp.by_segments((intermediate,), dim=1)} if tp.size > 1 else None)
        self.all_reduce = tp.all_reduce

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # down(silu(gate) * up): one fused call where the method has one for both layouts,
        # else the products and the backend's silu_mul
        gate_up = self.gate_up_proj
        return gate_up.method.apply_swiglu(gate_up, self.down_proj, x, ops.silu_mul)


class ParallelSwiGLU(SwiGLU):
    """A tensor-parallel rank's dense MLP: its output summed across ranks (here, not as
    down_proj's combine: apply_swiglu runs down_proj's product past the layer's own call)."""

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.all_reduce(super().forward(x, ops))


class Experts(nn.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]
    (E this rank's experts under tensor parallelism), as the loader fills them, run as F.linear
    on the stack.

    With a linear method (`use_method`, before loading: a quantization config's) each expert
    becomes a SwiGLU of projection layers of that method, child `{e}` of this module, so its
    projections' checkpoint names are the per-expert ones (`experts.{e}.gate_proj`, `.up_proj`,
    `.down_proj`), and the stacked tensors go. A method that reads a quantized checkpoint
    (its `checkpoint` set) gets those layers at once, before loading (models/load.py then
    chooses each one's method as for any projection layer, and the loader fills them with each
    expert's stored tensors); any other method gets them after loading, from the stacked float
    weights (online quantization)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, tp: TensorParallel = SINGLE):
        """tp: the experts split whole over the ranks (expert parallelism): rank r of N holds
        experts [r E/N, (r+1) E/N), `num_local` from `first`; a token routed to another rank's
        expert gets nothing from this one, and the MoE block sums the ranks' outputs."""
        super().__init__()
        self.num_experts, self.hidden, self.intermediate = num_experts, hidden, intermediate
        self.num_local = num_experts // tp.size
        self.first = tp.rank * self.num_local
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_local, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_local, hidden, intermediate))
        if tp.size > 1:
            shard_parameter(self.gate_up_proj, tp.by_segments((num_experts,)))
            shard_parameter(self.down_proj, tp.by_segments((num_experts,)))
        self.method: LinearMethod | None = None
        self.per_expert: list[SwiGLU] | None = None

    def use_method(self, method: LinearMethod, dtype: torch.dtype | None = None) -> None:
        self.method = method
        if getattr(method, "checkpoint", None) is not None:
            self._make_experts(method, dtype)

    def _make_experts(self, method: LinearMethod, dtype: torch.dtype | None) -> list[SwiGLU]:
        """Child `{e}` per local expert (e its index in the whole model, as the checkpoint names
        it), its weights on the meta device (to be loaded); the stacked tensors are dropped."""
        del self.gate_up_proj, self.down_proj
        self.per_expert = []
        for e in range(self.first, self.first + self.num_local):
            with torch.device("meta"):
                expert = SwiGLU(self.hidden, self.intermediate)
            expert.gate_up_proj.use_method(method, dtype)
            expert.down_proj.use_method(method, dtype)
            self.add_module(str(e), expert)
            self.per_expert.append(expert)
        return self.per_expert

    def process_weights_after_loading(self) -> None:
        if self.method is None or self.per_expert is not None or self.gate_up_proj.is_meta:
            return                       # float, or per-expert layers the model processes itself
        stacked_gate_up, stacked_down = self.gate_up_proj, self.down_proj
        for expert, gate_up, down in zip(self._make_experts(self.method, stacked_gate_up.dtype),
                                         stacked_gate_up, stacked_down):
            expert.gate_up_proj.weight_loader("gate_proj.weight", gate_up[:self.intermediate])
            expert.gate_up_proj.weight_loader("up_proj.weight", gate_up[self.intermediate:])
            expert.down_proj.weight_loader("down_proj.weight", down)
            expert.gate_up_proj.process_weights_after_loading()
            expert.down_proj.process_weights_after_loading()

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor, ops) -> torch.Tensor:
        """x [T, H]; expert_ids (the whole model's), weights [T, top_k]. Loops over this rank's
        experts that were hit."""
        out = torch.zeros_like(x)
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // expert_ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            local = e - self.first
            if n and 0 <= local < self.num_local:
                rows = token_of[start:start + n]
                if self.per_expert is None:
                    gate, up = F.linear(x[rows], self.gate_up_proj[local]).chunk(2, dim=-1)
                    y = F.linear(F.silu(gate) * up, self.down_proj[local])
                else:
                    y = self.per_expert[local](x[rows], ops)
                out.index_add_(0, rows, y * w_sorted[start:start + n, None])
            start += n
        return out


class SparseMoE(nn.Module):
    """The router (`gate`) and `shared_expert_gate` stay plain nn.Linear: tiny, and kept in float
    by every quantized format."""

    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        h = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size, tp)
        self.shared_expert = SwiGLU(h, cfg.shared_expert_intermediate_size, method, tp)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        self.all_reduce = tp.all_reduce

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # Softmax over ALL experts in fp32, then top-k, then (optionally) renormalise.
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_ids, top_w.to(x.dtype), ops)
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)


class ParallelSparseMoE(SparseMoE):
    """A tensor-parallel rank's MoE block: the router and shared_expert_gate whole (every rank
    routes every token; the gate is a per-token scale, so it applies to each rank's partial sum
    alike), the experts split whole over the ranks (expert parallelism), the shared expert by
    its intermediate rows, the block's output summed across ranks once."""

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        return self.all_reduce(super().forward(x, ops))


def make_mlp(cfg: ModelConfig, layer_idx: int, method: LinearMethod | None = None,
             tp: TensorParallel = SINGLE) -> nn.Module:
    if cfg.layer_is_moe(layer_idx):
        return (SparseMoE if tp.size == 1 else ParallelSparseMoE)(cfg, method, tp)
    return (SwiGLU if tp.size == 1 else ParallelSwiGLU)(cfg.hidden_size, cfg.intermediate_size, method, tp)
