"""Projections as the layers call them: `linear(x, weight)`, where `weight` is a plain tensor or,
after `prepare_projections`, the projection object kernels/cpu chose for it (its layout is
that object's business: kernels/cpu/projection.py).

Merged projections. At batch-1 decode every weight is read once per token and the step is bound
by memory bandwidth; one long GEMV streams better than three or four short ones, each with its
own call and thread fork-join. `merge_projections` concatenates the weights of the bias-free
`nn.Linear` children that read the same input into one non-persistent buffer and re-points each
child's weight at its rows: one copy of the weights, which state_dict, the loader and in-place
edits still see under the children's names. The merge is redone after every load_state_dict (a
hook), since loading with assign=True replaces the children's tensors. Which children read the
same input is the model's knowledge, so this stays here.
"""

from __future__ import annotations

import torch
from torch import nn

from hybrid_engine.kernels.cpu.projection import (PlainProjection, Projection, choose_projection, fused_swiglu,
                                                 plain_linear)


def linear(x: torch.Tensor, weight: torch.Tensor | Projection) -> torch.Tensor:
    """x W^T without bias."""
    if isinstance(weight, Projection):
        return weight(x)
    return plain_linear(x, weight)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor | Projection, down: torch.Tensor | Projection,
           silu_mul) -> torch.Tensor:
    """silu(gate) * up of x's merged [gate | up] projection, projected by `down`: one native
    call where both projections' layouts allow it (`fused_swiglu`), else three (silu_mul: the
    backend's op)."""
    if isinstance(gate_up, Projection) and isinstance(down, Projection):
        fused = fused_swiglu(x, gate_up, down)
        if fused is not None:
            return fused
    return linear(silu_mul(linear(x, gate_up)), down)


def merge_projections(module: nn.Module, buffer_name: str, children: list[str]) -> None:
    """Registers `module.<buffer_name>` = cat of the children's weights (rows in list order),
    now and after every load_state_dict of `module`. The row counts are `<buffer_name>_sizes`."""
    setattr(module, f"{buffer_name}_sizes", [getattr(module, c).out_features for c in children])
    module.merged_projections = {**getattr(module, "merged_projections", {}), buffer_name: children}

    def merge(mod: nn.Module, _incompatible_keys=None) -> None:
        weights = [getattr(mod, c).weight for c in children]
        merged = torch.cat([w.detach() for w in weights])
        start = 0
        for child, w in zip(children, weights):
            getattr(mod, child).weight = nn.Parameter(merged[start:start + w.shape[0]],
                                                      requires_grad=w.requires_grad)
            start += w.shape[0]
        mod.register_buffer(buffer_name, merged, persistent=False)

    module.register_load_state_dict_post_hook(merge)
    merge(module)


def prepare_projections(module: nn.Module, names: list[str], onednn: bool = True,
                        few_rows_copy: bool = True) -> bool:
    """Replaces module.<name> for each name (a merged-projection buffer or a child Linear's
    weight, "out_proj.weight") by the projection chosen for it (`choose_projection`; onednn and
    few_rows_copy as there), where that is not the plain weight itself. Inference only: the
    replaced weights leave state_dict, and a merged buffer's children lose their (now stale)
    weights to the meta device, so the old layout is freed. -> whether anything was replaced."""
    replaced = False
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        weight = getattr(owner, attr)
        if isinstance(weight, Projection):
            continue
        projection = choose_projection(weight, onednn, few_rows_copy)
        if isinstance(projection, PlainProjection):
            continue                    # the tensor itself computes the same through `linear`
        delattr(owner, attr)            # a parameter or buffer: an object cannot take its place
        setattr(owner, attr, projection)
        replaced = True
        for child in getattr(owner, "merged_projections", {}).get(attr, ()):
            old = getattr(owner, child).weight
            getattr(owner, child).weight = nn.Parameter(
                torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
    return replaced
