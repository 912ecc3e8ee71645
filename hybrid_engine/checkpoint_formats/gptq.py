"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`): a quantized projection `X` is
    X.qweight  int32 [in * bits / 32, out]: values packed along the input dimension, the first
               in the lowest bits
    X.qzeros   int32 [in / group, out * bits / 32]: zero points packed along the output one
    X.scales   float16 [in / group, out]
    X.g_idx    int32 [in]: each input column's group
with W[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]; checkpoint_format "gptq" (v1)
stores each zero point less one, "gptq_v2" as it is.

Read here: bits 4 and 8, groups a multiple of 32, symmetric (`sym: true`: every zero point
2^(bits-1), so W = (q - 8) * scale for int4, the kernels' own form; other zero points are refused
as a corrupt file) or asymmetric (`sym: false`: the zero points as stored, held beside the
scales, both less 2^(bits-1) as kernels/linear/quantized.py keeps them). A v1 zero point is its
field plus one, without wrapping (16 for a stored 15 at int4, as vLLM's GPTQ kernels read it);
an int8 one of 256 does not fit and is refused. With `desc_act` (activation order) a group's
columns are scattered over the input: the columns are reordered at load so that each group is
contiguous, and the layer gathers x into the same order before each product (an index_select
of x's few rows, exact).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybrid_engine.kernels.linear.quantized import QuantizedWeight, check_scheme
from hybrid_engine.models.config import CheckpointError

from .int32_fields import unpack_fields
from .rank_parts import Along, StoredParts

QUANT_METHOD = "gptq"


@dataclass(frozen=True)
class Gptq(StoredParts):
    """The QuantizedCheckpoint of kernels/linear/quantized.py for GPTQ."""
    bits: int
    group_size: int
    zero_offset: int                         # v1 stores each zero point less one
    symmetric: bool = True
    act_order: bool = False                  # desc_act, which tensor parallelism refuses (quantization.py)
    marker: str = "qweight"

    def scheme_for(self, module: str):
        return self                          # one scheme for every quantized module

    def tensor_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        groups = in_features // self.group_size
        return {"qweight": (in_features * self.bits // 32, rows), "qzeros": (groups, rows * self.bits // 32),
                "scales": (groups, rows), "g_idx": (in_features,)}

    def read(self, name: str, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> QuantizedWeight:
        for suffix in ("qweight", "qzeros"):
            if tensors[suffix].dtype != torch.int32:
                raise CheckpointError(f"tensor {name}.{suffix} is {tensors[suffix].dtype}, not int32")
        middle = 1 << (self.bits - 1)
        zeros = unpack_fields(tensors["qzeros"], self.bits, dim=1)[:, :rows] + self.zero_offset - middle
        if self.symmetric and zeros.any():
            raise CheckpointError(f"tensor {name}.qzeros holds zero points other than {middle}, but the "
                                  "config says sym: true")
        if int(zeros.max()) > 127:
            raise CheckpointError(f"tensor {name}.qzeros holds a zero point of {int(zeros.max()) + middle}, "
                                  f"beyond {self.bits} bits")
        values = (unpack_fields(tensors["qweight"], self.bits, dim=0) - middle).t()          # [out, in]
        scales = tensors["scales"]
        if not scales.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name}.scales is {scales.dtype}, not floating point")
        g_idx = tensors["g_idx"].to(torch.int64)
        order = torch.argsort(g_idx, stable=True)                  # each group's columns together
        expected = torch.arange(in_features) // self.group_size
        if not torch.equal(g_idx[order], expected):
            raise CheckpointError(f"tensor {name}.g_idx does not put {self.group_size} columns in each of "
                                  f"{in_features // self.group_size} groups")
        in_order = torch.equal(order, torch.arange(in_features))
        return QuantizedWeight(values[:, order].to(torch.int8).contiguous(), scales.t().to(torch.float16).contiguous(),
                               self.bits, self.group_size, None if in_order else order,
                               None if self.symmetric else zeros.t().to(torch.int8).contiguous())

    @property
    def split_blocks(self) -> tuple[int, int]:
        """The weight's rows and input columns a rank's part must hold whole: the zero points'
        packed words along the rows (stored even where symmetric), the groups along the columns."""
        return 32 // self.bits, self.group_size

    def rank_part(self, name: str, tensor: torch.Tensor, split) -> torch.Tensor:
        part = super().rank_part(name, tensor, split)
        if name.endswith(".g_idx") and split.dim == 1:
            # With act-order a group's columns are scattered over the input, so a rank's input
            # columns would hold pieces of many groups, none whole: the kernels need whole ones.
            if not torch.equal(tensor.to(torch.int64), torch.arange(tensor.numel()) // self.group_size):
                raise CheckpointError(f"tensor {name} orders the columns by activation (desc_act), which "
                                      "tensor_parallel_size > 1 does not split yet")
            part = part - part[0]                  # the rank's groups from 0
        return part

    def _along(self, suffix: str) -> tuple[Along | None, Along]:
        words, groups = 32 // self.bits, Along(0, self.group_size)
        return {"qweight": (Along(1, 1), Along(0, words)), "qzeros": (Along(1, words), groups),
                "scales": (Along(1, 1), groups), "g_idx": (None, Along(0, 1))}[suffix]


def read_config(quant: dict, where: str) -> Gptq:
    """quantization_config (quant_method gptq) -> its scheme; CheckpointError naming the field."""
    bits, group = quant.get("bits"), quant.get("group_size")
    if bits not in (4, 8):
        raise CheckpointError(f"{where}.bits {bits!r} is not supported (4 or 8)")
    symmetric = quant.get("sym", True)
    if not isinstance(symmetric, bool):
        raise CheckpointError(f"{where}.sym is {symmetric!r}, not true or false")
    if not isinstance(group, int) or isinstance(group, bool) or group <= 0 or group % 32:
        raise CheckpointError(f"{where}.group_size {group!r} is not supported (a multiple of 32; per-channel -1 "
                              "is not read yet)")
    check_scheme(bits, group)
    version = quant.get("checkpoint_format", "gptq")
    if version not in ("gptq", "gptq_v2"):
        raise CheckpointError(f"{where}.checkpoint_format {version!r} is not supported (gptq or gptq_v2)")
    return Gptq(bits, group, 1 if version == "gptq" else 0, symmetric, bool(quant.get("desc_act", False)))
