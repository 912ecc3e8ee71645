"""Projection layers: a model declares each projection by its logical shape, and the linear method
it is given (kernels/linear/reference.py; chosen by the engine's kernel backend) owns the weights behind it:
what the loader fills, the layout after loading, and the product.

Merged projections. At batch-1 decode every weight is read once per token and the step is bound
by memory bandwidth; one long GEMV streams better than three or four short ones, each with its
own call and thread fork-join. So projections that read the same input are one `Linear` with one
output size per shard (`Linear(h, {"q_proj": ..., "k_proj": ..., "v_proj": ...})`): the
checkpoint's tensors keep their own names (`<parent>.q_proj.weight`), and the loader hands each
to the merged layer's `weight_loader`, which writes its rows. Which projections read the same
input is the model's knowledge, so that stays here; how their weights are laid out is not.

Tensor parallelism (models/parallel.py). A sharded layer is declared at its rank's sizes with a
`Split` per checkpoint projection: it reports the checkpoint's full shapes, and its
`weight_loader` slices each tensor to the rank's part before its method takes it, so methods
never see the full weight. A layer whose output is a partial sum across ranks (row-parallel) or
a part of the vocabulary (lm_head) has a `combine` that follows every product.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from hybrid_engine.kernels.linear import LinearMethod

from .parallel import Split


class Linear(nn.Module):
    """x W^T (no bias) for W [sum(output sizes), in_features].

    shards: None for a projection stored under this layer's own name (`<name>.weight`), or
    {checkpoint name: output rows} for projections merged into one product, their rows in
    that order (the output splits back by `output_sizes`).

    Under tensor parallelism the sizes are this rank's; splits: {shard name (None for a layer
    of one projection): the rank's Split of that checkpoint tensor}; combine: what joins the
    ranks' outputs after each product (the all-reduce of a row-parallel layer, lm_head's
    gather), None where nothing does."""

    def __init__(self, in_features: int, out_features: int | None = None,
                 shards: dict[str, int] | None = None, method: LinearMethod | None = None,
                 splits: dict[str | None, Split] | None = None, combine=None):
        super().__init__()
        if (out_features is None) == (shards is None):
            raise ValueError("Linear takes either out_features or shards")
        self.in_features = in_features
        self.shards = dict(shards) if shards is not None else None
        self.output_sizes = list(self.shards.values()) if shards is not None else [out_features]
        self.out_features = sum(self.output_sizes)
        self.method = method or LinearMethod()
        self.splits = splits or {}
        self.combine = combine
        self.method.create_weights(self, in_features, self.out_features)
        self._bind(functools.partial(self.method.apply, self))

    def _bind(self, product) -> None:
        """The layer's callable: the method's product, then the ranks' combine where there is one
        (a layer without one runs its method's product directly, as in a single process)."""
        combine = self.combine
        self._product = product if combine is None else lambda x: combine(product(x))

    def use_method(self, method: LinearMethod, dtype: torch.dtype | None = None) -> None:
        """Before loading: holds this layer's weights with `method` instead (a per-layer choice,
        such as a quantization config's, made once the model's layer names are known); dtype:
        the model's, which the layer's products take and give."""
        if not self.weight.is_meta:
            raise RuntimeError("use_method: the layer's weights are loaded already")
        self.method = method
        method.create_weights(self, self.in_features, self.out_features, dtype)
        self._bind(functools.partial(method.apply, self))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._product(x)

    # Called directly, past nn.Module.__call__'s hook machinery (projection layers take no
    # hooks): a decode step makes about fifty projection calls, and an eager step of a small
    # model is bound by such per-call overheads. For the same reason the product is the
    # method's own callable for this layer (`LinearMethod.product`), kept on the layer.
    __call__ = forward

    def checkpoint_shapes(self, prefix: str) -> dict[str, tuple[int, ...]]:
        """The checkpoint tensors this layer loads (names relative to the model), with shapes: what
        its method holds (a plain `weight` per projection, or a quantized checkpoint's tensors).
        prefix: this layer's own name in the model ("layers.0.self_attn.qkv_proj")."""
        shapes = self.method.checkpoint_tensors(self, prefix)
        if not self.splits:
            return shapes
        return {name: self.method.full_shape(name, shape, self._split_of(name)) for name, shape in shapes.items()}

    def weight_loader(self, name: str, loaded: torch.Tensor) -> None:
        """Takes one checkpoint tensor (a name of `checkpoint_shapes`), as the method holds it:
        under tensor parallelism the rank's part of it."""
        if self.splits:
            loaded = self.method.rank_part(name, loaded, self._split_of(name))
        self.method.load_tensor(self, name, loaded)

    def _split_of(self, name: str) -> Split:
        """The Split of checkpoint tensor `name` (`<...>.<shard>.<tensor>`): of the projection's
        [out, in] weight, which the method maps to each tensor it stores (`LinearMethod.rank_part`)."""
        if self.shards is None:
            return self.splits[None]
        return self.splits[name.rpartition(".")[0].rpartition(".")[2]]

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)
        self._bind(self.method.product(self))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids], from wherever the method holds W."""
        return self.method.rows(self, ids)

    def extra_repr(self) -> str:
        shards = f", shards={self.shards}" if self.shards else ""
        return f"in={self.in_features}, out={self.out_features}{shards}, method={self.method!r}"

