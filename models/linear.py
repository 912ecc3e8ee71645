"""Projection weights laid out the way the matmul wants them.

Two changes of layout, both invisible to checkpoint names:

- Merged projections. At batch-1 decode every weight is read once per token and the step is
  bound by memory bandwidth; one long GEMV streams better than three or four short ones, each
  with its own call and thread fork-join. `merge_projections` concatenates the weights of the
  bias-free `nn.Linear` children that read the same input into one non-persistent buffer and
  re-points each child's weight at its rows: one copy of the weights, which state_dict, the
  loader and in-place edits still see under the children's names. The merge is redone after
  every load_state_dict (a hook), since loading with assign=True replaces the children's tensors.

- Packed weights (CPU, bfloat16 / float16). PyTorch's plain bf16 matmul converts as it goes and
  reaches about 2/3 of the bandwidth oneDNN gets from a weight reordered once into its blocked
  layout (AMX / AVX512-BF16 kernels), at batch 1 and batched alike. `pack_weights` does that
  reorder in place: the packed tensor is opaque, so forwards read projection weights only
  through `linear`, and state_dict no longer returns usable tensors (inference only). float32
  stays on MKL: its GEMV is 10-20% faster than oneDNN's at batch 1, the roofline case.

- Transposed float32 products for a few rows. For 8-32 rows of x (batched decode, verify of
  several requests), MKL computes x W^T 1.1-1.6x slower than W x^T (measured: the 248320-row
  lm_head at 16 rows 163 vs 106 ms, the 0.8B MLP's gate_up 134 vs 99 ms over 24 layers, 2
  threads), so `linear` asks for the latter there and transposes the small result back. At 1-3
  rows MKL's GEMV path is faster (W x^T takes twice as long); from 64 rows on x W^T wins again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_DTYPES = (torch.bfloat16, torch.float16)
TRANSPOSED_ROWS = range(8, 33)      # rows of x for which float32 W x^T beats x W^T on CPU


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; oneDNN's matmul when `weight` was packed by `pack_weights`."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    # (Not while traced: a test of the symbolic row count would specialise the compiled graph.)
    if (not torch.compiler.is_compiling() and x.dim() == 2 and x.shape[0] in TRANSPOSED_ROWS
            and weight.dtype == torch.float32 and x.device.type == "cpu"):
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)


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


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES
            and torch.backends.mkldnn.is_available())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight reordered for oneDNN (batch-size hint 1: decode; batched and prefill
    shapes measured no slower than with the plain weight)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def pack_weights(module: nn.Module, names: list[str]) -> None:
    """Packs module.<name> for each name: a merged-projection buffer or a child Linear's weight
    ("out_proj.weight"). A merged buffer's children lose their (now stale) weights to the meta
    device, so the old layout is freed."""
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        weight = getattr(owner, attr)
        if not can_pack(weight) or weight.is_mkldnn:
            continue
        packed = pack_weight(weight)
        if isinstance(weight, nn.Parameter):
            setattr(owner, attr, nn.Parameter(packed, requires_grad=False))
        else:
            owner.register_buffer(attr, packed, persistent=False)
        for child in getattr(owner, "merged_projections", {}).get(attr, ()):
            old = getattr(owner, child).weight
            getattr(owner, child).weight = nn.Parameter(
                torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
