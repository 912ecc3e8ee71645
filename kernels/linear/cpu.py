"""The cpu backend's linear method (`CpuLinearMethod`) and the weight-layout policy behind it:
for each projection weight W [out, in], the layout its products x W^T run fastest from, chosen
once after loading (`choose_projection`) and applied by calling the object. Models declare
projections by shape (models/linear.py) and know no layout. The measurements behind each rule
are in benchmarks/history/RESULTS_LOG.md (search "projection"); the current figures in
benchmarks/RESULTS.md.

Layouts, by what the process's level allows (kernels/native/isa.py):

- Plain: the weight as loaded: float32 and bf16 weights the native kernel cannot take, and
  float16 ones where oneDNN does not pack them. Every blockable
  float32 weight is blocked, small ones too, on every vendor's CPU: on other vendors' CPUs MKL
  runs generic code, slower than the native kernel for small shapes; on Intel's, where MKL's
  GEMV is tuned, a small weight's product is over in microseconds either way, but an MLP whose
  two weights are both blocked runs in one native call (`fused_swiglu`), and at MTP verify's
  few rows the kernel beats MKL, which leaves its GEMV path at 4 rows. For 8-32 rows MKL computes
  float32 x W^T slower than W x^T, so `plain_linear` (kernels/linear/reference.py) asks for the latter.

- Blocked (the native kernel, kernels/linear/blocked.py): float32 W becomes [N/16, K, 16] and every
  product runs in the hand-written kernel, which streams as fast as MKL's GEMV at 1 row and
  faster at the few rows of MTP verify and small batches, on par for prefill. bf16 W is blocked
  too where oneDNN may not pack it, at every size (AVX2: torch's bf16 matmul has no fast path
  there and took about 3x the kernel's time for the default model's 150 KB mtp.fc,
  benchmarks/RESULTS.md issue 39; see Widening below). One copy of the weights replaces the
  plain one.

- Widening (bf16 where neither oneDNN packs it nor the level has a bf16 dot product: AVX2): the
  blocked bf16 weight, one copy. Few rows widen W in registers (the product is bound by memory,
  the extra ops are free); from WIDEN_MIN_ROWS rows on (prefill, big batches) the kernel widens
  W's tiles to float32 once per call and runs its float32 tiles, since widening in registers
  costs two more ALU ops per FMA pair once the product is bound by arithmetic. Same FMAs, same
  order: same results.

- oneDNN-packed (bf16 / fp16 where `onednn_packs`): PyTorch's plain bf16 matmul converts as it
  goes and reaches well under the bandwidth oneDNN gets from a weight reordered once into its
  blocked layout (AMX / AVX512-BF16 kernels), at batch 1 and batched alike. The packed tensor is
  opaque (inference only). Compiled steps (onednn=False) keep such weights plain instead:
  inductor's freezing packs the weights of its graphs itself.

- Few-rows split: a bf16 weight that oneDNN packs (or that compiled steps leave plain for it)
  also gets a blocked copy for products of at most FEW_ROWS rows of x (batch-1 decode, MTP
  verify at k <= 3): there the native kernel's AVX512-BF16 dot products stream faster than
  oneDNN, while from 8 rows on oneDNN's AMX kernel is faster. The price is a second copy of the
  bf16 weights. A weight under BLOCKED_MIN_BYTES (the default model's, the MTP head's fc at its
  dims) takes its copy up to SMALL_FEW_ROWS rows: there a oneDNN call's fixed cost made it 2-3x
  slower than the kernel at 1-5 rows and no faster at 64, and one kernel for MTP verify's rows
  gives a row the same bits as in a decode (benchmarks/RESULTS.md, issue 39). Under
  torch.compile the row count test is on the input's (symbolic) shape: dynamo guards on it, so
  a graph traced for few rows and one for more each take their own branch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch import nn

from ..native.isa import at_least, onednn_packs
from .blocked import BLOCK, block_weight, blocked_linear, blocked_rows, can_block
from .reference import LinearMethod, plain_linear

BLOCKED_MIN_BYTES = 1 << 20         # smaller bf16 weights: their blocked copy up to SMALL_FEW_ROWS rows
FEW_ROWS = 4                        # bf16 products of at most this many rows take the blocked copy
SMALL_FEW_ROWS = 16                 # the same for weights under BLOCKED_MIN_BYTES
WIDEN_MIN_ROWS = 16                 # bf16 products of at least this many rows widen W's tiles (AVX2)


class Projection:
    """x W^T for one weight in the layout chosen for it. `replaces_weight`: the object holds
    the weight's values in a layout of its own and needs no plain copy beside it (the method
    frees the plain weight); `rows(ids)` then still reads W[ids] (a tied embedding table)."""

    replaces_weight = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} cannot gather weight rows")


class PlainProjection(Projection):
    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return plain_linear(x, self.weight)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class BlockedProjection(Projection):
    """A weight whose row count is not a multiple of BLOCK (the default model's GDN in_proj: 392)
    is blocked with zero rows after it and the padded columns of the product are dropped: left
    plain it would run in MKL, which on a cold cache (the step's other weights just passed
    through L2) took about twice the kernel's time there on AMD's CPUs (MKL's generic code;
    benchmarks/history/RESULTS_LOG.md)."""

    replaces_weight = True

    def __init__(self, weight: torch.Tensor):
        self.out_features, self.in_features = weight.shape
        pad = -self.out_features % BLOCK
        # (padded only where needed: F.pad copies even by zero rows, a transient second copy of
        # e.g. a 1 GB lm_head at load)
        self.blocked = block_weight(F.pad(weight.detach(), (0, 0, 0, pad)) if pad else weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._crop(blocked_linear(x, self.blocked))

    def widens(self, rows: int) -> bool:
        """Whether a product of `rows` rows of x takes the kernel's widened-tile form."""
        return False

    def _crop(self, y: torch.Tensor) -> torch.Tensor:
        if y.shape[-1] == self.out_features:
            return y
        return y[..., :self.out_features].contiguous()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        # the native gather (blocked_linear.cpp blocked_rows): as torch indexing, a compiled step
        # inlined it into every consumer of the embedding, each far slower than one copy
        return blocked_rows(self.blocked, ids, self.in_features)


class WideningProjection(BlockedProjection):
    """A blocked bf16 weight at a level without a bf16 dot product: WIDEN_MIN_ROWS rows or more
    take the kernel's widened-tile form (the module docstring)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._crop(blocked_linear(x, self.blocked, widen=self.widens(x.numel() // x.shape[-1])))

    def widens(self, rows: int) -> bool:
        return rows >= WIDEN_MIN_ROWS


class OneDNNProjection(Projection):
    def __init__(self, weight: torch.Tensor):
        # batch-size hint 1: decode; batched and prefill shapes measured no slower than plain
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


class FewRowsSplit(Projection):
    """`few` for products of at most max_rows rows of x, `many` for more."""

    def __init__(self, many: Projection, few: BlockedProjection, max_rows: int = FEW_ROWS):
        self.many, self.few, self.max_rows = many, few, max_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        return self.few(x) if rows <= self.max_rows else self.many(x)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.many.rows(ids)


def _register_form(projection: Projection, rows) -> BlockedProjection | None:
    """The blocked projection whose register-tile form (linear_blocked, widen=False) serves a
    product of `rows` rows of x from `projection`, where it needs no crop; else None. `rows`
    may be symbolic in a traced step: the tests are the ones the projections' own calls make
    (FewRowsSplit, Widening), so they guard on nothing new."""
    if isinstance(projection, FewRowsSplit):
        if rows > projection.max_rows:
            return None
        projection = projection.few
    if isinstance(projection, WideningProjection):
        if rows >= WIDEN_MIN_ROWS:
            return None
    elif type(projection) is not BlockedProjection:
        return None
    return projection if projection.blocked.shape[0] * BLOCK == projection.out_features else None


def fused_swiglu(x: torch.Tensor, gate_up: Projection, down: Projection) -> torch.Tensor | None:
    """silu_mul(x Wgu^T) Wd^T in one native call (mlp_blocked: both products and the activation
    in one OpenMP region, the same values as the three calls) where both weights run the
    kernel's register form at this row count; else None, and the caller makes the three calls.
    gate_up is the merged [gate | up] projection."""
    rows = x.numel() // x.shape[-1]
    gu, d = _register_form(gate_up, rows), _register_form(down, rows)
    if (gu is None or d is None or not (x.dtype == gu.blocked.dtype == d.blocked.dtype)
            or d.in_features * 2 != gu.out_features):
        return None
    return torch.ops.hybrid_engine_cpu.mlp_blocked.default(x, gu.blocked, d.blocked)


def choose_projection(weight: torch.Tensor, onednn: bool = True, few_rows_copy: bool = True,
                      blocked: bool = False) -> Projection:
    """The layout for a [out, in] weight (see the module docstring). onednn=False: weights
    oneDNN would pack stay plain (compiled steps pack their own); few_rows_copy=False: no
    blocked bf16 copy beside a packed or plain weight; blocked=True: a bf16 weight the kernel
    takes is blocked whatever its size and whatever oneDNN would do (`CpuLinearMethod.tail_method`)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.is_meta:
        return PlainProjection(weight)
    if weight.dtype == torch.float32:
        return BlockedProjection(weight) if can_block(weight, padded=True) else PlainProjection(weight)
    bf16_blockable = weight.dtype == torch.bfloat16 and can_block(weight, padded=True)
    if bf16_blockable and (blocked or not onednn_packs(weight.dtype)):
        return BlockedProjection(weight) if at_least("avx512_bf16") else WideningProjection(weight)
    if not onednn_packs(weight.dtype):
        return PlainProjection(weight)
    many = OneDNNProjection(weight) if onednn else PlainProjection(weight)
    if few_rows_copy and bf16_blockable:
        small = weight.numel() * weight.element_size() < BLOCKED_MIN_BYTES
        return FewRowsSplit(many, BlockedProjection(weight), SMALL_FEW_ROWS if small else FEW_ROWS)
    return many


class CpuLinearMethod(LinearMethod):
    """The cpu backend's linear method: after loading, each weight takes the layout
    `choose_projection` picks for it (`layer.layout`; None where that is the plain weight
    itself), which every product then runs from, and the plain weight is freed. onednn,
    few_rows_copy: as `choose_projection` takes them (compiled steps: onednn=False, inductor
    packs its own)."""

    def __init__(self, onednn: bool = True, few_rows_copy: bool = True, blocked: bool = False):
        self.onednn, self.few_rows_copy, self.blocked = onednn, few_rows_copy, blocked

    def create_weights(self, layer: nn.Module, in_features: int, out_features: int,
                       dtype: torch.dtype | None = None) -> None:
        super().create_weights(layer, in_features, out_features, dtype)
        layer.layout = None                 # the plain weight until processed

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        layout = choose_projection(weight, self.onednn, self.few_rows_copy, self.blocked)
        layer.layout = None if isinstance(layout, PlainProjection) else layout
        if layer.layout is not None:
            layer.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                        requires_grad=False)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if layer.layout is None:
            return plain_linear(x, layer.weight)
        return layer.layout(x)

    def product(self, layer: nn.Module):
        return layer.layout if layer.layout is not None else super().product(layer)

    def apply_swiglu(self, gate_up: nn.Module, down: nn.Module, x: torch.Tensor, silu_mul) -> torch.Tensor:
        if gate_up.layout is not None and isinstance(down.method, CpuLinearMethod) and down.layout is not None:
            fused = fused_swiglu(x, gate_up.layout, down.layout)
            if fused is not None:
                return fused
        return super().apply_swiglu(gate_up, down, x, silu_mul)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return layer.weight[ids] if layer.layout is None else layer.layout.rows(ids)

    def holds_weight_elsewhere(self, layer: nn.Module) -> bool:
        return layer.layout is not None and layer.layout.replaces_weight

    def tail_method(self) -> "CpuLinearMethod":
        """A quantized layer's float tail (GDN's in_proj_b / in_proj_a: 2 x 16 rows at 0.8B dims)
        in the blocked kernel at every size: alone it is small enough for oneDNN, whose call
        cost dwarfs such a product (tens of microseconds a call, 18 calls a 0.8B decode step),
        and one kernel for every row count gives a row the same bits in any batch (MTP's
        lossless verify)."""
        return CpuLinearMethod(self.onednn, self.few_rows_copy, blocked=True)

    def __repr__(self) -> str:
        blocked = ", blocked=True" if self.blocked else ""
        return f"CpuLinearMethod(onednn={self.onednn}, few_rows_copy={self.few_rows_copy}{blocked})"
