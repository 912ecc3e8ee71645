"""Weight-only quantized projections: int8 and int4 values in groups along k, one float16 scale per
output row and group, W[n, k] = q[n, k] * scale[n, k // group]. The torch reference and the
native kernel (quant_linear.cpp) of the product, and the linear method that holds a layer's
weights this way (`QuantizedLinearMethod`).

Quantizing (`quantize`) follows llama.cpp's Q8_0 and Q4_0 rules, so accuracy compares like for
like: int8 scale = max|w| / 127 and q = round(w / scale) in [-127, 127]; int4 scale = m / -8 for
the group's value m of largest magnitude and q = round(w / scale) clamped to [-8, 7] (the extreme
value lands on -8, the code int4 otherwise leaves unused). The scale is rounded to float16 first
and q computed from the rounded scale.

Packed layout (`pack`, what the kernel reads; N padded to a multiple of 16 with zero rows):
    q       uint8 [N/16, K * bits / 8, 16]: int8 values' bits, or for int4 one byte per column
            and pair of k (k = 2 k2 in the low nibble, 2 k2 + 1 in the high one, each q + 8)
    scales  float16 [N/16, K / group, 16]
Every dequantized value q * scale is exact in float32, and the kernel multiplies in float32 in k
order, so its product equals the float32 blocked kernel's on the dequantized weights bitwise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .reference import LinearMethod, plain_linear

BLOCK = 16
BITS = (8, 4)
_QMAX = {8: 127, 4: 7}
_QMIN = {8: -127, 4: -8}



class QuantizedWeight(NamedTuple):
    """A quantized [N, K] weight as formats hand it over: values int8 [N, K] (in [-127, 127] or
    [-8, 7]), scales float16 [N, K / group_size]."""
    values: torch.Tensor
    scales: torch.Tensor
    bits: int
    group_size: int


def check_scheme(bits: int, group_size: int, in_features: int | None = None) -> None:
    if bits not in BITS:
        raise ValueError(f"quantized weights have 8 or 4 bits, not {bits}")
    if not isinstance(group_size, int) or group_size < 2 or (bits == 4 and group_size % 2):
        raise ValueError(f"group size {group_size!r} is not an {'even ' if bits == 4 else ''}int >= 2")
    if in_features is not None and in_features % group_size:
        raise ValueError(f"group size {group_size} does not divide the {in_features} input columns")


def quantize(weight: torch.Tensor, bits: int, group_size: int) -> QuantizedWeight:
    """weight [N, K] (any float dtype) -> its int8 / int4 groups (the module docstring's rule)."""
    n, k = weight.shape
    check_scheme(bits, group_size, k)
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    if bits == 8:
        scale = w.abs().amax(dim=-1) / 127
    else:
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        scale = extreme / -8
    scale = scale.half()
    inverse = torch.where(scale != 0, 1.0 / scale.float(), torch.zeros_like(scale, dtype=torch.float32))
    q = torch.round(w * inverse[..., None]).clamp_(_QMIN[bits], _QMAX[bits]).to(torch.int8)
    return QuantizedWeight(q.reshape(n, k), scale, bits, group_size)


def dequantize(qw: QuantizedWeight) -> torch.Tensor:
    """The float32 [N, K] weight a QuantizedWeight stands for."""
    n, k = qw.values.shape
    groups = qw.values.float().reshape(n, k // qw.group_size, qw.group_size)
    return (groups * qw.scales.float()[..., None]).reshape(n, k)


def pack(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's layout (the module docstring): (q uint8, scales float16), N padded to 16."""
    values, scales = qw.values, qw.scales
    pad = -values.shape[0] % BLOCK
    if pad:
        values, scales = F.pad(values, (0, 0, 0, pad)), F.pad(scales, (0, 0, 0, pad))
    n, k = values.shape
    blocks = values.reshape(n // BLOCK, BLOCK, k).transpose(1, 2)          # [N/16, K, 16]
    if qw.bits == 8:
        q = blocks.contiguous().view(torch.uint8)
    else:
        u = (blocks.to(torch.int16) + 8).to(torch.uint8)
        q = (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()                  # [N/16, K/2, 16]
    return q, scales.reshape(n // BLOCK, BLOCK, -1).transpose(1, 2).contiguous()


def unpack(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int,
           rows: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 dequantized weight [N_padded, K] from the packed layout, or only its `rows`
    (int64 ids: a tied embedding reading lm_head's table)."""
    if rows is not None:
        q, scales = q[rows // BLOCK, :, rows % BLOCK], scales[rows // BLOCK, :, rows % BLOCK]   # [n, K'], [n, G]
    else:
        q = q.transpose(1, 2).reshape(-1, q.shape[1])
        scales = scales.transpose(1, 2).reshape(-1, scales.shape[1])
    if bits == 8:
        values = q.view(torch.int8).float()
    else:
        pairs = torch.stack([(q & 15), (q >> 4)], dim=-1).reshape(q.shape[0], -1)
        values = pairs.float() - 8
    n, k = values.shape
    return (values.reshape(n, k // group_size, group_size) * scales.float()[..., None]).reshape(n, k)


def quant_linear_reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int,
                           group_size: int) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N_padded] in torch ops (float32 accumulation), x's dtype out."""
    return (x.float() @ unpack(q, scales, bits, group_size).t()).to(x.dtype)


def quant_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """The same with the native kernel (kernels/native: the process's level must run it)."""
    return torch.ops.hybrid_engine_cpu.linear_quant.default(x, q, scales, bits, group_size)


class QuantizedLinearMethod(LinearMethod):
    """A layer whose float weight is quantized once after loading (online quantization), or
    that a quantized checkpoint fills (`load_quantized`), held packed; products by the native
    kernel (native=True, the cpu backend where it builds) or the torch reference.

    float_shards: shards of a merged layer kept in float (GDN's in_proj_b / in_proj_a, which
    every quantized format keeps float: they feed the decay and the gate's sigmoid); they must
    be the layer's last rows, and run as a plain product beside the quantized one."""

    def __init__(self, bits: int, group_size: int, native: bool = False, float_shards: tuple[str, ...] = ()):
        check_scheme(bits, group_size)
        self.bits, self.group_size, self.native = bits, group_size, native
        self.float_shards = tuple(float_shards)

    def _float_rows(self, layer: nn.Module) -> int:
        if not self.float_shards:
            return 0
        names = list(layer.shards or {})
        tail = names[len(names) - len(self.float_shards):]
        if sorted(tail) != sorted(self.float_shards):
            raise ValueError(f"float shards {self.float_shards} are not the last of {names}")
        return sum(layer.shards[name] for name in self.float_shards)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        weight = layer.weight
        if weight.is_meta:
            return
        float_rows = self._float_rows(layer)
        quantized_rows = weight.shape[0] - float_rows
        self.load_quantized(layer, quantize(weight[:quantized_rows], self.bits, self.group_size),
                            weight[quantized_rows:] if float_rows else None, weight.dtype)

    def load_quantized(self, layer: nn.Module, qw: QuantizedWeight, float_tail: torch.Tensor | None,
                       dtype: torch.dtype) -> None:
        """Holds `qw` packed (and the float tail rows, if any) as the layer's weights; the plain
        weight is freed. dtype: the activations' (the rows a tied embedding reads come in it)."""
        if (qw.bits, qw.group_size) != (self.bits, self.group_size):
            raise ValueError(f"int{qw.bits} weights in groups of {qw.group_size} handed to a method of "
                             f"int{self.bits} in groups of {self.group_size}")
        layer.quantized_rows = qw.values.shape[0]
        layer.qweight, layer.qscales = pack(qw)
        layer.float_tail = None if float_tail is None else float_tail.detach().to(dtype).clone()
        layer.weight_dtype = dtype
        layer.weight = nn.Parameter(torch.empty(layer.weight.shape, dtype=dtype, device="meta"), requires_grad=False)

    def _quantized_product(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        product = quant_linear if self.native and x.device.type == "cpu" else quant_linear_reference
        y = product(x, layer.qweight, layer.qscales, self.bits, self.group_size)
        return y if y.shape[-1] == layer.quantized_rows else y[..., :layer.quantized_rows]

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = self._quantized_product(layer, x)
        if layer.float_tail is None:
            return y if y.is_contiguous() else y.contiguous()
        return torch.cat([y, plain_linear(x, layer.float_tail)], dim=-1)

    def product(self, layer: nn.Module):
        return functools.partial(self.apply, layer)

    def rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        if layer.float_tail is not None:
            raise NotImplementedError("rows of a layer with float shards")
        return unpack(layer.qweight, layer.qscales, self.bits, self.group_size, rows=ids).to(layer.weight_dtype)

    def holds_weight_elsewhere(self, layer: nn.Module) -> bool:
        return True

    def __repr__(self) -> str:
        tail = f", float_shards={self.float_shards}" if self.float_shards else ""
        return f"QuantizedLinearMethod(int{self.bits}, group_size={self.group_size}, native={self.native}{tail})"
