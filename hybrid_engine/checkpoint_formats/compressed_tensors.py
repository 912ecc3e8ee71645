"""compressed-tensors `pack-quantized` checkpoints (llm-compressor's W4A16 / W8A16; what vLLM
loads): reading them, and writing them (`hybrid-engine quantize`).

A quantized projection `X` is stored as
    X.weight_packed      int32 [out, in * bits / 32]: values q + 2^(bits-1), 32 / bits per int32,
                         the first in the lowest bits
    X.weight_scale       float [out, in / group_size]: W = q * scale
    X.weight_shape       int [2]: (out, in)
and, where the weights are asymmetric (`symmetric: false`), W = (q - zero) * scale with
    X.weight_zero_point  int32 [ceil(out * bits / 32), in / group_size]: zero points z + 2^(bits-1)
                         (z in q's signed range), packed as weight_packed but along the output
                         dimension (compressed-tensors' pack_to_int32 with packed_dim=0)
with config.json's `quantization_config`: {"quant_method": "compressed-tensors", "format":
"pack-quantized", "config_groups": {NAME: {"targets": [...], "weights": {"num_bits": 4 | 8,
"type": "int", "symmetric": true | false, "strategy": "group", "group_size": G, ...}}},
"ignore": [...]}. Which projections are quantized is read from the tensors themselves (a
`weight_packed` beside the name), so an `ignore` list written any way works; which group's
scheme a quantized one has, from the groups' `targets`, by compressed-tensors' own rules
(utils/match.py): a target is a module name (the checkpoint's, `model.layers.0.mlp.down_proj`),
`re:` and a regex matched from the name's start (re.match), or a class name (`Linear`: every
projection). A quantized module that no group or two groups match is one error naming it.
Supported here: int, symmetric or not, group strategy with a group size the kernel takes (a
multiple of 32); anything else is refused with the field that says so. Activation ordering
(`actorder`, g_idx) is not read yet.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from hybrid_engine.kernels.linear.quantized import QuantizedWeight, check_scheme
from hybrid_engine.models.config import CheckpointError

from .int32_fields import pack_fields, unpack_fields
from .rank_parts import Along, StoredParts

QUANT_METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


@dataclass(frozen=True)
class PackQuantized(StoredParts):
    """One config group's weights: the QuantizedCheckpoint of kernels/linear/quantized.py."""
    bits: int
    group_size: int
    symmetric: bool = True
    marker: str = "weight_packed"          # the tensor beside a projection that says it is quantized

    def tensor_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        shapes = {"weight_packed": (rows, math.ceil(in_features * self.bits / 32)),
                  "weight_scale": (rows, in_features // self.group_size), "weight_shape": (2,)}
        if not self.symmetric:
            shapes["weight_zero_point"] = (math.ceil(rows * self.bits / 32), in_features // self.group_size)
        return shapes

    def read(self, name: str, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> QuantizedWeight:
        packed, scale, shape = tensors["weight_packed"], tensors["weight_scale"], tensors["weight_shape"]
        if packed.dtype != torch.int32:
            raise CheckpointError(f"tensor {name}.weight_packed is {packed.dtype}, not int32")
        if shape.dtype.is_floating_point or [int(v) for v in shape.reshape(-1)] != [rows, in_features]:
            raise CheckpointError(f"tensor {name}.weight_shape holds {shape.tolist()}, not [{rows}, {in_features}]")
        if not scale.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name}.weight_scale is {scale.dtype}, not floating point")
        values = unpack_int32(packed, self.bits, in_features)
        scales = scale.to(torch.float16)
        if not torch.isfinite(scales).all():
            raise CheckpointError(f"tensor {name}.weight_scale holds values float16 cannot hold "
                                  "(NaN, Inf, or beyond 65504)")
        zeros = None
        if not self.symmetric:
            zero_point = tensors["weight_zero_point"]
            if zero_point.dtype != torch.int32:
                raise CheckpointError(f"tensor {name}.weight_zero_point is {zero_point.dtype}, not int32")
            zeros = unpack_int32(zero_point, self.bits, rows, dim=0)
        return QuantizedWeight(values, scales, self.bits, self.group_size, zeros=zeros)

    @property
    def split_blocks(self) -> tuple[int, int]:
        """The weight's rows and input columns a rank's part must hold whole: the zero points'
        packed words along the rows, the groups along the columns."""
        return (1 if self.symmetric else 32 // self.bits), self.group_size

    def rank_part(self, name: str, tensor: torch.Tensor, split) -> torch.Tensor:
        if name.endswith(".weight_shape"):            # the rank's [out, in], as `read` checks it
            local = tensor.reshape(-1).clone()
            local[split.dim] = split.local_size()
            return local
        return super().rank_part(name, tensor, split)

    def _along(self, suffix: str) -> tuple[Along, Along]:
        words, groups = 32 // self.bits, Along(1, self.group_size)
        return {"weight_packed": (Along(0, 1), Along(1, words)), "weight_scale": (Along(0, 1), groups),
                "weight_zero_point": (Along(0, words), groups),
                "weight_shape": (None, None)}[suffix]           # its stored shape, whole on every rank


def pack_int32(values: torch.Tensor, bits: int, dim: int = 1) -> torch.Tensor:
    """int8 values [out, in] -> weight_packed int32 [out, ceil(in * bits / 32)]; dim=0: zero
    points [out, groups] -> weight_zero_point int32 [ceil(out * bits / 32), groups]."""
    return pack_fields(values.to(torch.int64) + (1 << (bits - 1)), bits, dim=dim)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """weight_packed int32 -> the int8 values [out, length]; dim=0: weight_zero_point -> the
    zero points [length, groups]."""
    fields = unpack_fields(packed, bits, dim=dim).narrow(dim, 0, length)
    return (fields - (1 << (bits - 1))).to(torch.int8)


CLASS_TARGETS = ("Linear",)         # the class every projection is (the one class name a target here names)


@dataclass(frozen=True)
class ConfigGroups:
    """A checkpoint's config groups: (name, targets, scheme) each; `scheme_for` says which one a
    quantized module loads with."""
    groups: tuple[tuple[str, tuple[str, ...], PackQuantized], ...]
    where: str
    marker: str = "weight_packed"

    def scheme_for(self, module: str) -> PackQuantized:
        """module: its checkpoint name (`model.layers.0.mlp.down_proj`), quantized in the checkpoint."""
        found = [(name, scheme) for name, targets, scheme in self.groups
                 if any(target_matches(target, module) for target in targets)]
        if not found:
            raise CheckpointError(f"{self.where}.config_groups: no group's targets match {module}, which the "
                                  "checkpoint holds quantized")
        if len(found) > 1:
            raise CheckpointError(f"{self.where}.config_groups: {module} is matched by the targets of "
                                  f"{' and '.join(name for name, _ in found)}; a module belongs to one group")
        return found[0][1]

    @property
    def split_blocks(self) -> tuple[int, int]:
        """PackQuantized.split_blocks that every group's modules keep whole."""
        blocks = [scheme.split_blocks for _, _, scheme in self.groups]
        return math.lcm(*(rows for rows, _ in blocks)), math.lcm(*(columns for _, columns in blocks))


def target_matches(target: str, module: str) -> bool:
    """compressed-tensors' match of a target and a projection module's name."""
    if target.startswith("re:"):
        return re.match(target.removeprefix("re:"), module) is not None
    return target == module or target in CLASS_TARGETS


def read_config(quant: dict, where: str) -> ConfigGroups:
    """quantization_config (quant_method compressed-tensors) -> its groups; CheckpointError naming
    the field for one this engine does not read."""
    if quant.get("format") != FORMAT:
        raise CheckpointError(f"{where}.format {quant.get('format')!r} is not supported (only {FORMAT!r})")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}.config_groups must hold at least one group, got {groups!r}")
    return ConfigGroups(tuple((name, _read_targets(group, f"{where}.config_groups.{name}"),
                               _read_group(group, f"{where}.config_groups.{name}"))
                              for name, group in groups.items()), where)


def _read_targets(group, field: str) -> tuple[str, ...]:
    targets = group.get("targets") if isinstance(group, dict) else None
    if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
        raise CheckpointError(f"{field}.targets must be a non-empty list of names, got {targets!r}")
    for target in targets:
        if target.startswith("re:"):
            try:
                re.compile(target.removeprefix("re:"))
            except re.error as e:
                raise CheckpointError(f"{field}.targets: {target!r} is not a regex: {e}") from None
    return tuple(targets)


def _read_group(group: dict, where: str) -> PackQuantized:
    weights = group.get("weights")
    field = f"{where}.weights"
    if not isinstance(weights, dict):
        raise CheckpointError(f"{field} is missing")
    expected = {"type": "int", "strategy": "group"}
    for key, value in expected.items():
        if weights.get(key) != value:
            raise CheckpointError(f"{field}.{key} is {weights.get(key)!r}; this engine reads {value!r} only")
    symmetric = weights.get("symmetric")
    if not isinstance(symmetric, bool):
        raise CheckpointError(f"{field}.symmetric is {symmetric!r}, not true or false")
    if weights.get("actorder") not in (None, False):
        raise CheckpointError(f"{field}.actorder {weights.get('actorder')!r} is not supported")
    if group.get("input_activations") is not None:
        raise CheckpointError(f"{where}.input_activations is set: only weight-only "
                              "quantization (W4A16, W8A16) is supported")
    bits, group_size = weights.get("num_bits"), weights.get("group_size")
    if bits not in (4, 8):
        raise CheckpointError(f"{field}.num_bits {bits!r} is not supported (4 or 8)")
    try:
        check_scheme(bits, group_size)
    except ValueError as e:
        raise CheckpointError(f"{field}.group_size: {e}") from None
    if group_size % 32:
        raise CheckpointError(f"{field}.group_size {group_size} is not a multiple of 32, which the kernels need")
    return PackQuantized(bits, group_size, symmetric)


def quantization_config(groups: list[tuple[PackQuantized, list[str]]], ignore: list[str]) -> dict:
    """config.json's quantization_config for checkpoints `hybrid-engine quantize` writes: one
    config group per (scheme, its targets)."""
    return {
        "quant_method": QUANT_METHOD, "format": FORMAT, "quantization_status": "compressed",
        "config_groups": {f"group_{i}": {
            "targets": list(targets),
            "weights": {"num_bits": scheme.bits, "type": "int", "symmetric": True, "strategy": "group",
                        "group_size": scheme.group_size, "dynamic": False, "actorder": None,
                        "observer": "minmax"},
            "input_activations": None, "output_activations": None} for i, (scheme, targets) in enumerate(groups)},
        "ignore": sorted(ignore),
    }
