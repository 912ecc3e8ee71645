"""Projection weights laid out the way the matmul wants them.

Changes of layout, all invisible to checkpoint names:

- Merged projections. At batch-1 decode every weight is read once per token and the step is
  bound by memory bandwidth; one long GEMV streams better than three or four short ones, each
  with its own call and thread fork-join. `merge_projections` concatenates the weights of the
  bias-free `nn.Linear` children that read the same input into one non-persistent buffer and
  re-points each child's weight at its rows: one copy of the weights, which state_dict, the
  loader and in-place edits still see under the children's names. The merge is redone after
  every load_state_dict (a hook), since loading with assign=True replaces the children's tensors.

- Blocked float32 weights (CPU, where the native kernel builds: kernels/cpu/blocked.py).
  W [N, K] becomes [N/16, K, 16] and every product runs in the hand-written kernel: at 1 row it
  streams as fast as MKL's GEMV (1.0-1.1x), at 4 rows (MTP verify) 1.7-1.9x MKL, at 16 rows
  (batched decode) 1.4-1.5x MKL's best form, at 512 rows (prefill) on par. One copy of the
  weights replaces the plain one. `linear` takes a weight of more than 2 dims as blocked.

- Packed weights (CPU, bfloat16 / float16). PyTorch's plain bf16 matmul converts as it goes and
  reaches about 2/3 of the bandwidth oneDNN gets from a weight reordered once into its blocked
  layout (AMX / AVX512-BF16 kernels), at batch 1 and batched alike. `pack_weights` does that
  reorder in place: the packed tensor is opaque, so forwards read projection weights only
  through `linear`, and state_dict no longer returns usable tensors (inference only). The
  native kernel also takes bf16 (AVX512-BF16 dot products) and streams 1.2-1.5x faster than
  oneDNN at 1-4 rows, but AMX is faster from 8 rows on (1.7x at 16, more for prefill), so a
  packed bf16 weight may carry a blocked copy for products of 1-4 rows (`add_few_rows_twin`).

- Transposed float32 products for a few rows, where weights stay unblocked (no native kernel).
  For 8-32 rows of x, MKL computes x W^T 1.1-1.6x slower than W x^T (measured: the 248320-row
  lm_head at 16 rows 163 vs 106 ms, the 0.8B MLP's gate_up 134 vs 99 ms over 24 layers, 2
  threads), so `linear` asks for the latter there and transposes the small result back. At 1-3
  rows MKL's GEMV path is faster (W x^T takes twice as long); from 64 rows on x W^T wins again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybrid_engine.kernels.cpu import block_weight, blocked_linear, can_block
from hybrid_engine.kernels.cpu.isa import onednn_packs

PACKED_DTYPES = (torch.bfloat16, torch.float16)
TRANSPOSED_ROWS = range(8, 33)      # rows of x for which float32 W x^T beats x W^T on CPU
# Smaller float32 weights stay on MKL: a product of a few hundred KB is over in microseconds,
# and the native kernel's call (ctypes, output allocation) costs a few more than MKL's (the
# default model's 192-wide projections: batch-1 step 5.5 -> 5.9 ms when blocked).
BLOCKED_MIN_BYTES = 1 << 20
# bf16 products of at most this many rows of x run from the blocked copy of a packed weight.
FEW_ROWS = 4


# Set by hybrid_engine/compiled_steps.py around each compiled call: whether its products have at
# most FEW_ROWS rows. Traced code reads it as a constant (dynamo guards on it: one graph each way),
# where a test of the symbolic row count would specialise the graph.
few_rows_graph = False


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear without bias; the native kernel for a blocked weight, oneDNN's matmul for a
    packed one (`pack_weights`); a weight's blocked copy for few rows (`add_few_rows_twin`)."""
    if weight.dim() > 2:
        return blocked_linear(x, weight)
    few_rows = getattr(weight, "few_rows", None)
    if few_rows is not None and (few_rows_graph if torch.compiler.is_compiling()
                                 else x.numel() <= FEW_ROWS * x.shape[-1]):
        return blocked_linear(x, few_rows)
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


def can_pack(weight: torch.Tensor, onednn: bool = True) -> bool:
    """Whether `pack_weight` changes this weight's layout: blocked, or (unless onednn=False)
    oneDNN-packed."""
    return can_block_float32(weight) or (onednn and can_pack_onednn(weight))


def can_pack_onednn(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and onednn_packs(weight.dtype)


def can_block_float32(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.float32 and worth_blocking(weight) and can_block(weight)


def worth_blocking(weight: torch.Tensor) -> bool:
    return weight.numel() * weight.element_size() >= BLOCKED_MIN_BYTES


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A [out, in] weight in the layout its products run fastest from: blocked for the native
    kernel (float32), or reordered for oneDNN (bf16/fp16; batch-size hint 1: decode; batched and
    prefill shapes measured no slower than with the plain weight)."""
    if can_block_float32(weight):
        return block_weight(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def add_few_rows_twin(packed: torch.Tensor, weight: torch.Tensor) -> None:
    """A bf16 weight, oneDNN-packed or (under compiled steps, whose graphs pack their own) plain,
    gets a blocked copy as `packed.few_rows` for products of up to FEW_ROWS rows (batch-1 decode,
    MTP verify at k <= 3): there the native kernel's AVX512-BF16 dot products stream 1.3-1.5x
    faster than oneDNN (26-28 vs 18-20 GB/s at 0.8B shapes), while from 8 rows on oneDNN's AMX
    kernel is faster, 2.5x at 32 rows and more for prefill. The price is a second copy of the
    bf16 weights (as much memory as float32 weights)."""
    if (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and worth_blocking(weight)
            and can_block(weight)):
        packed.few_rows = block_weight(weight)


def add_plain_few_rows_twin(weight: torch.Tensor, onednn: bool) -> None:
    """With onednn=False (compiled steps: inductor packs the weights of its graphs) a bf16
    weight oneDNN would have packed stays plain and gets the few-rows copy itself."""
    if not onednn and can_pack_onednn(weight):
        add_few_rows_twin(weight, weight)


def pack_weights(module: nn.Module, names: list[str], onednn: bool = True, few_rows_copy: bool = True) -> None:
    """Packs module.<name> for each name: a merged-projection buffer or a child Linear's weight
    ("out_proj.weight"); onednn=False leaves the weights oneDNN would pack as they are (bf16
    ones still get their few-rows copy); few_rows_copy=False skips `add_few_rows_twin`. A merged
    buffer's children lose their (now stale) weights to the meta device, so the old layout is
    freed."""
    for name in names:
        owner_path, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_path)
        weight = getattr(owner, attr)
        if weight.is_mkldnn or weight.dim() != 2:
            continue
        if not can_pack(weight, onednn):
            if few_rows_copy:
                add_plain_few_rows_twin(weight, onednn)
            continue
        packed = pack_weight(weight)
        if isinstance(weight, nn.Parameter):
            packed = nn.Parameter(packed, requires_grad=False)
            setattr(owner, attr, packed)
        else:
            owner.register_buffer(attr, packed, persistent=False)
        if few_rows_copy:
            add_few_rows_twin(packed, weight)
        for child in getattr(owner, "merged_projections", {}).get(attr, ()):
            old = getattr(owner, child).weight
            getattr(owner, child).weight = nn.Parameter(
                torch.empty(old.shape, dtype=old.dtype, device="meta"), requires_grad=False)
