"""Feed-forward blocks: dense SwiGLU and the sparse MoE with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from hybrid_engine.kernels.linear import LinearMethod

from .linear import Linear


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, method: LinearMethod | None = None):
        super().__init__()
        self.gate_up_proj = Linear(hidden, shards={"gate_proj": intermediate, "up_proj": intermediate}, method=method)
        self.down_proj = Linear(intermediate, hidden, method=method)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # down(silu(gate) * up): one fused call where the method has one for both layouts,
        # else the products and the backend's silu_mul
        gate_up = self.gate_up_proj
        return gate_up.method.apply_swiglu(gate_up, self.down_proj, x, ops.silu_mul)


class Experts(nn.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I],
    as the loader fills them. With a linear method (`use_method`, before loading: a quantization
    config's) each expert's two projections become projection layers of that method after
    loading and the stacked tensors are freed; without one they run as F.linear on the stack."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.hidden, self.intermediate = hidden, intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.method: LinearMethod | None = None
        self.gate_up_layers = self.down_layers = None

    def use_method(self, method: LinearMethod) -> None:
        self.method = method

    def process_weights_after_loading(self) -> None:
        if self.method is None or self.gate_up_proj.is_meta:
            return
        self.gate_up_layers = nn.ModuleList(_layer(w, self.method) for w in self.gate_up_proj)
        self.down_layers = nn.ModuleList(_layer(w, self.method) for w in self.down_proj)
        for name in ("gate_up_proj", "down_proj"):
            stacked = getattr(self, name)
            setattr(self, name, nn.Parameter(torch.empty(stacked.shape, dtype=stacked.dtype, device="meta"),
                                             requires_grad=False))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H]; expert_ids, weights [T, top_k]. Loops over the experts that were hit."""
        out = torch.zeros_like(x)
        flat_ids = expert_ids.reshape(-1)
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // expert_ids.shape[1]
        w_sorted = weights.reshape(-1)[order]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            if self.gate_up_layers is None:
                gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, self.down_proj[e])
            else:
                gate, up = self.gate_up_layers[e](x[rows]).chunk(2, dim=-1)
                y = self.down_layers[e](F.silu(gate) * up)
            out.index_add_(0, rows, y * w_sorted[start:start + n, None])
            start += n
        return out


def _layer(weight: torch.Tensor, method: LinearMethod) -> Linear:
    """One expert's projection as a projection layer of `method`, loaded with `weight`."""
    with torch.device("meta"):
        layer = Linear(weight.shape[1], weight.shape[0], method=method)
    layer.weight_loader("expert.weight", weight)
    layer.process_weights_after_loading()
    return layer


class SparseMoE(nn.Module):
    """The router (`gate`) and `shared_expert_gate` stay plain nn.Linear: tiny, and kept in float
    by every quantized format."""

    def __init__(self, cfg: ModelConfig, method: LinearMethod | None = None):
        super().__init__()
        h = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, cfg.shared_expert_intermediate_size, method)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # Softmax over ALL experts in fp32, then top-k, then (optionally) renormalise.
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_ids, top_w.to(x.dtype))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)


def make_mlp(cfg: ModelConfig, layer_idx: int, method: LinearMethod | None = None) -> nn.Module:
    if cfg.layer_is_moe(layer_idx):
        return SparseMoE(cfg, method)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, method)
