"""Qwen's FP8 checkpoints (Qwen3.5-27B-FP8, -35B-A3B-FP8, ...): `quantization_config`
{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "modules_to_not_convert":
[...]}. A quantized projection `X` is `X.weight` (float8_e4m3 [out, in]) with `X.weight_scale_inv`
[ceil(out / 128), ceil(in / 128)] (bf16, fp16 or fp32): despite its name the scale multiplies,
W[i, j] = fp8[i, j] * scale_inv[i // 128, j // 128], the last blocks cut at the edges.

Which projections are FP8 is read per tensor (a `weight_scale_inv` beside it), not from
modules_to_not_convert: loaders that trusted the list misread tensors (PEERS.md).

On a CPU there is no FP8 arithmetic: the weights are dequantized at load and requantized to int8
in groups of 32 (the kernels' int8; per 32 columns of one row the int8 rounding is finer than
e4m3's 3-bit mantissa over 128 x 128, so it adds little: the error is measured in the tests
against the dequantized weights). int8 reads half bf16's bytes per token, so it is the faster
of the two on every CPU level here. MoE experts are read the same way, each expert's
gate_proj / up_proj / down_proj (`mlp.experts.{e}.gate_proj.weight` with its `weight_scale_inv`,
as Qwen3.5-35B-A3B-FP8 and its larger siblings store them) a projection layer of its own
(models/mlp.py Experts). Not read yet: Qwen3-Next's grouped in_proj_qkvz in FP8 (its scale
blocks span the interleaved rows); the loader refuses it as a tensor it does not expect.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from hybrid_engine.kernels.linear.quantized import QuantizedWeight, quantize
from hybrid_engine.models.config import CheckpointError

from .rank_parts import Along, StoredParts

QUANT_METHOD = "fp8"
REQUANTIZED_BITS, REQUANTIZED_GROUP = 8, 32


@dataclass(frozen=True)
class Fp8Blocks(StoredParts):
    """The QuantizedCheckpoint of kernels/linear/quantized.py for FP8 block-scaled weights."""
    block_rows: int
    block_cols: int
    bits: int = REQUANTIZED_BITS
    group_size: int = REQUANTIZED_GROUP
    marker: str = "weight_scale_inv"       # the tensor beside a projection that says it is FP8

    def scheme_for(self, module: str):
        return self                          # one scheme for every quantized module

    def tensor_shapes(self, rows: int, in_features: int) -> dict[str, tuple[int, ...]]:
        return {"weight": (rows, in_features),
                "weight_scale_inv": (math.ceil(rows / self.block_rows), math.ceil(in_features / self.block_cols))}

    def read(self, name: str, tensors: dict[str, torch.Tensor], rows: int, in_features: int) -> QuantizedWeight:
        scale = tensors["weight_scale_inv"]
        if not scale.dtype.is_floating_point:
            raise CheckpointError(f"tensor {name}.weight_scale_inv is {scale.dtype}, not floating point")
        expanded = (scale.float().repeat_interleave(self.block_rows, dim=0)[:rows]
                    .repeat_interleave(self.block_cols, dim=1)[:, :in_features])
        weight = tensors["weight"].float() * expanded
        if not torch.isfinite(weight).all():
            raise CheckpointError(f"tensor {name}.weight times its weight_scale_inv holds NaN or Inf")
        return quantize(weight, self.bits, self.group_size)

    @property
    def split_blocks(self) -> tuple[int, int]:
        """The weight's rows and input columns a rank's part must hold whole: the scale blocks."""
        return self.block_rows, self.block_cols

    def _along(self, suffix: str) -> tuple[Along, Along]:
        if suffix == "weight":
            return Along(0, 1), Along(1, 1)
        return Along(0, self.block_rows), Along(1, self.block_cols)


def read_config(quant: dict, where: str) -> Fp8Blocks:
    """quantization_config (quant_method fp8) -> its scheme; CheckpointError naming the field."""
    if quant.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}.fmt {quant.get('fmt')!r} is not supported (e4m3 only)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(f"{where}.activation_scheme {quant.get('activation_scheme')!r} is not supported "
                              "(dynamic only: weights are what is read)")
    block = quant.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"{where}.weight_block_size must be [rows, cols] of positive ints, got {block!r} "
                              "(per-tensor FP8 scales are not supported)")
    return Fp8Blocks(block[0], block[1])


def quantization_config(block: tuple[int, int] = (128, 128), not_converted: list[str] = ()) -> dict:
    """The quantization_config of Qwen's FP8 releases (what the tests write)."""
    return {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block), "modules_to_not_convert": list(not_converted)}


def config_of(folder: str | Path) -> dict | None:
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("quantization_config") if isinstance(config, dict) else None
