"""Linear methods: how a projection's weights are held and applied (vLLM's LinearMethodBase split).

A model declares its projections as layers with logical shapes (models/linear.py `Linear`:
in_features, and one output size per shard where several projections that read the same input
are merged into one product). A `LinearMethod`, chosen by the engine's kernel backend (and, as
quantized formats arrive, by the checkpoint's quantization config), owns everything about the
weights behind that shape:

    create_weights(layer, ...)           the tensors the loader fills (here: one `weight`)
    process_weights_after_loading(layer) the layout the products run from (cpu: blocked,
                                         oneDNN-packed, a few-rows copy; kernels/linear/cpu.py)
    apply(layer, x)                      x W^T (`product(layer)`: the same as one callable)
    apply_swiglu(gate_up, down, x, act)  down(act(gate_up(x))), one fused call where a method has it
    rows(layer, ids)                     W[ids] (a tied embedding reading lm_head's table)

This module holds the interface and the reference method (`LinearMethod`: the plain weight as
loaded, torch ops only), which the torch and triton backends use. The cpu backend's method is
kernels/linear/cpu.py `CpuLinearMethod`. The methods know layers only as modules with the
attributes they set themselves; they import nothing from the models.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# Rows of x for which float32 W x^T beats x W^T on a CPU's BLAS (MKL's GEMV path ends at 3 rows,
# its GEMM from 64 rows on serves x W^T best again): benchmarks/history/RESULTS_LOG.md.
TRANSPOSED_ROWS = range(8, 33)


def plain_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W^T from a plain [out, in] weight, in torch ops."""
    if (not torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] in TRANSPOSED_ROWS
            and weight.dtype == torch.float32 and x.device.type == "cpu"):
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)


def shard_names(layer: nn.Module, prefix: str) -> list[tuple[str, int]]:
    """(checkpoint name of each projection without its tensor suffix, its rows): the layer's own
    name, or for a merged layer `<parent>.<shard>` per shard, in row order."""
    if layer.shards is None:
        return [(prefix, layer.out_features)]
    parent = prefix.rpartition(".")[0]
    parent = parent + "." if parent else ""
    return [(f"{parent}{shard}", rows) for shard, rows in layer.shards.items()]


class LinearMethod:
    """The reference method: one plain [out, in] weight, applied with torch ops."""

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype | None = None) -> None:
        """Registers what the loader fills: `layer.weight` [out, in] (on the device in scope:
        the meta device while a model is built for loading)."""
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self, layer: nn.Module, prefix: str) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors the layer loads (names relative to the model) with their shapes:
        one `weight` per projection; prefix: the layer's own name ("layers.0.self_attn.qkv_proj").
        A merged layer (layer.shards) names each of its projections: `<parent>.<shard>.weight`."""
        return {f"{name}.weight": (rows, layer.in_features) for name, rows in shard_names(layer, prefix)}

    def rank_part(self, name: str, loaded: torch.Tensor, split) -> torch.Tensor:
        """Under tensor parallelism: this rank's part of checkpoint tensor `name`, where `split`
        (models/parallel.py Split) is the rank's part of the projection's [out, in] weight. A
        tensor with fewer entries than the weight along the split's dim (group scales) is cut at
        the same groups (`Split.per_entry`)."""
        return split.per_entry(sum(split.segments) // loaded.shape[split.dim]).take(loaded)

    def full_shape(self, name: str, shape: tuple[int, ...], split) -> tuple[int, ...]:
        """The checkpoint's shape of tensor `name`, of which this rank holds `shape` (`rank_part`)."""
        return split.per_entry(split.local_size() // shape[split.dim]).full_shape(shape)

    def load_tensor(self, layer: nn.Module, name: str, loaded: torch.Tensor) -> None:
        """Takes one checkpoint tensor (a name of `checkpoint_tensors`). A single projection keeps
        the loaded tensor itself (no copy); a merged one writes it into its rows."""
        if layer.shards is None:
            layer.weight = nn.Parameter(loaded, requires_grad=False)
            return
        shard = name.rpartition(".")[0].rpartition(".")[2]
        if layer.weight.is_meta:
            layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=loaded.dtype,
                                                    device=loaded.device), requires_grad=False)
        names = list(layer.shards)
        start = sum(layer.output_sizes[:names.index(shard)])
        layer.weight.data[start:start + layer.shards[shard]].copy_(loaded)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Once, after every weight of the layer is loaded: the plain weight stays as it is."""

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return plain_linear(x, layer.weight)

    def product(self, layer: nn.Module):
        """After processing: the callable x -> apply(layer, x), as directly as the method can
        give it (the layer keeps it: one call less per product in eager steps)."""
        return functools.partial(self.apply, layer)

    def apply_swiglu(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor, silu_mul) -> torch.Tensor:
        """silu(gate) * up of x's merged [gate | up] projection, projected by `down`."""
        return down.method.apply(down, silu_mul(self.apply(gate_up, x)))

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids]

    def tail_method(self) -> "LinearMethod":
        """The method for a few float rows run beside another product (a quantized layer's float
        tail shards, kernels/linear/quantized.py): here this one."""
        return self

    def holds_weight_elsewhere(self, layer: nn.Module) -> bool:
        """Whether, after processing, the layer's values live in a layout of the method's own
        that also serves `rows`: a tied embedding table can then be freed and read through it."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
