"""Feed-forward blocks: dense SwiGLU and the sparse MoE with a gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .linear import merge_projections, swiglu


class SwiGLU(nn.Module):
    PACKED_WEIGHTS = ["gate_up_weight", "down_proj.weight"]

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        merge_projections(self, "gate_up_weight", ["gate_proj", "up_proj"])

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # one native call where the weights' layouts allow, else the products and the
        # backend's silu_mul: chosen by the weights and x alone, per call
        return swiglu(x, self.gate_up_weight, self.down_proj.weight, ops.silu_mul)


class Experts(nn.Module):
    """Stacked expert weights: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))

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
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w_sorted[start:start + n, None]
            out.index_add_(0, rows, y)
            start += n
        return out


class SparseMoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.hidden_size
        self.top_k = cfg.num_experts_per_tok
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(h, cfg.num_experts, bias=False)
        self.experts = Experts(cfg.num_experts, h, cfg.moe_intermediate_size)
        self.shared_expert = SwiGLU(h, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor, ops) -> torch.Tensor:
        # Softmax over ALL experts in fp32, then top-k, then (optionally) renormalise.
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        top_w, top_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_ids, top_w.to(x.dtype))
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)


def make_mlp(cfg: ModelConfig, layer_idx: int) -> nn.Module:
    if cfg.layer_is_moe(layer_idx):
        return SparseMoE(cfg)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size)
