"""Projection layers: a model declares each projection by its logical shape, and the linear method
it is given (kernels/linear.py; chosen by the engine's kernel backend) owns the weights behind it:
what the loader fills, the layout after loading, and the product.

Merged projections. At batch-1 decode every weight is read once per token and the step is bound
by memory bandwidth; one long GEMV streams better than three or four short ones, each with its
own call and thread fork-join. So projections that read the same input are one `Linear` with one
output size per shard (`Linear(h, {"q_proj": ..., "k_proj": ..., "v_proj": ...})`): the
checkpoint's tensors keep their own names (`<parent>.q_proj.weight`), and the loader hands each
to the merged layer's `weight_loader`, which writes its rows. Which projections read the same
input is the model's knowledge, so that stays here; how their weights are laid out is not.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.kernels.linear import LinearMethod


class Linear(nn.Module):
    """x W^T (no bias) for W [sum(output sizes), in_features].

    shards: None for a projection stored under this layer's own name (`<name>.weight`), or
    {checkpoint name: output rows} for projections merged into one product, their rows in
    that order (the output splits back with `split`)."""

    def __init__(self, in_features: int, out_features: int | None = None,
                 shards: dict[str, int] | None = None, method: LinearMethod | None = None):
        super().__init__()
        if (out_features is None) == (shards is None):
            raise ValueError("Linear takes either out_features or shards")
        self.in_features = in_features
        self.shards = dict(shards) if shards is not None else None
        self.output_sizes = list(self.shards.values()) if shards is not None else [out_features]
        self.out_features = sum(self.output_sizes)
        self.method = method or LinearMethod()
        self.method.create_weights(self, in_features, self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """A merged layer's output -> one view per shard."""
        return y.split(self.output_sizes, dim=-1)

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this layer loads (names relative to the model), with shapes.
        prefix: this layer's own name in the model ("layers.0.self_attn.qkv_proj")."""
        if self.shards is None:
            return {f"{prefix}.weight": (self.out_features, self.in_features)}
        parent = prefix.rpartition(".")[0]
        parent = parent + "." if parent else ""
        return {f"{parent}{shard}.weight": (rows, self.in_features) for shard, rows in self.shards.items()}

    def weight_loader(self, name: str, loaded: torch.Tensor) -> None:
        """Takes one checkpoint tensor (a name of `checkpoint_shapes`). A single projection keeps
        the loaded tensor itself (no copy); a merged one writes it into its rows."""
        if self.shards is None:
            self.weight = nn.Parameter(loaded, requires_grad=False)
            return
        shard = name.rpartition(".")[0].rpartition(".")[2]
        if self.weight.is_meta:
            self.weight = nn.Parameter(torch.empty(self.out_features, self.in_features, dtype=loaded.dtype,
                                                   device=loaded.device), requires_grad=False)
        names = list(self.shards)
        start = sum(self.output_sizes[:names.index(shard)])
        self.weight.data[start:start + self.shards[shard]].copy_(loaded)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids], from wherever the method holds W."""
        return self.method.rows(self, ids)

    def extra_repr(self) -> str:
        shards = f", shards={self.shards}" if self.shards else ""
        return f"in={self.in_features}, out={self.out_features}{shards}, method={self.method!r}"


def swiglu(x: torch.Tensor, gate_up: Linear, down: Linear, silu_mul) -> torch.Tensor:
    """silu(gate) * up of x's merged [gate | up] projection, projected by `down`: one fused call
    where the method has one for both layers' layouts, else three (silu_mul: the backend's op)."""
    return gate_up.method.apply_swiglu(gate_up, down, x, silu_mul)
