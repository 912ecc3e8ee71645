"""Mixed precision by measurement (`hybrid-engine quantize --plan auto --max-bytes B`): the
quantizable projections grouped into kinds, each kind's bytes at int4, int8 and float as a
checkpoint holds them, and the plan: each kind's precision, chosen to minimise the summed
sensitivity (hybrid_engine/sensitivity.py measures it) within a byte budget.

Kinds follow the layers the engine loads, since a merged layer runs one scheme (and vLLM
requires one per fused layer too): GDN's in_proj_qkv and in_proj_z are one kind (`gdn.in_proj`,
Qwen3-Next's grouped in_proj_qkvz), attention's q/k/v one (`attn.qkv`), the MLP's gate and up
one (`mlp.gate_up`), the shared expert's likewise; the MTP layer's projections are one kind
(`mtp`), lm_head one (an untied one: a tied lm_head stays float with its embedding, as
`hybrid-engine quantize` keeps it). What stays float in every plan (GDN's in_proj_b / a,
mtp.fc, routers, MoE experts, norms, embeddings) counts as fixed bytes.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

FLOAT = None                     # a kind kept float (at the checkpoint's own dtype)
PRECISIONS = (FLOAT, 8, 4)       # most precise first: the planner's order among equals
SHAPE_BYTES = 2 * 4              # weight_shape: int32 [2] per quantized projection
SCALE_BYTES = 2                  # weight_scale: float16 per group
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}      # safetensors' dtypes

# a projection's path inside its layer -> its kind (a path not here is a kind of its own)
KINDS = {
    "linear_attn.in_proj_qkv": "gdn.in_proj", "linear_attn.in_proj_z": "gdn.in_proj",
    "linear_attn.in_proj_qkvz": "gdn.in_proj", "linear_attn.out_proj": "gdn.out_proj",
    "self_attn.q_proj": "attn.qkv", "self_attn.k_proj": "attn.qkv", "self_attn.v_proj": "attn.qkv",
    "self_attn.o_proj": "attn.o_proj",
    "mlp.gate_proj": "mlp.gate_up", "mlp.up_proj": "mlp.gate_up", "mlp.down_proj": "mlp.down_proj",
    "mlp.shared_expert.gate_proj": "shared_expert.gate_up", "mlp.shared_expert.up_proj": "shared_expert.gate_up",
    "mlp.shared_expert.down_proj": "shared_expert.down_proj",
}


def kind_of(name: str) -> str:
    """The internal name of a quantizable weight (`layers.3.self_attn.q_proj.weight`) -> its kind."""
    if name.startswith("mtp."):
        return "mtp"
    parts = name.removesuffix(".weight").split(".")
    if parts[0] != "layers":
        return ".".join(parts)                   # lm_head
    path = ".".join(parts[2:])
    if parts[2:4] == ["mlp", "experts"]:         # mlp.experts.{e}.gate_proj: every expert alike
        return "experts.down_proj" if parts[-1] == "down_proj" else "experts.gate_up"
    return KINDS.get(path, path)


def packed_bytes(rows: int, in_features: int, bits: int, group_size: int) -> int:
    """A projection's bytes in a pack-quantized checkpoint: int32 words, float16 scales, its shape."""
    words = rows * math.ceil(in_features * bits / 32)
    return words * 4 + rows * (in_features // group_size) * SCALE_BYTES + SHAPE_BYTES


@dataclass
class CheckpointSizes:
    """A float checkpoint's bytes as a quantized copy would hold them: each kind's at every
    precision, and the bytes every plan keeps as stored."""
    kinds: dict[str, dict[int | None, int]]      # kind -> precision -> bytes
    names: dict[str, set[str]]                   # kind -> the internal names of its weights
    fixed: int

    def total(self, plan: dict[str, int | None]) -> int:
        return self.fixed + sum(self.kinds[kind][bits] for kind, bits in plan.items())


def checkpoint_sizes(folder: str | Path, quantizable: set[str], group_size: int) -> CheckpointSizes:
    """quantizable: the internal names of the weights a plan may quantize (quantize_checkpoint.py
    quantized_names); read from the safetensors headers only."""
    from .models.loader import map_name

    kinds: dict[str, dict[int | None, int]] = {}
    names: dict[str, set[str]] = {}
    fixed = 0
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                piece = f.get_slice(key)
                shape, size = piece.get_shape(), _DTYPE_BYTES[piece.get_dtype()]
                name = map_name(key)
                if name not in quantizable:
                    fixed += math.prod(shape) * size
                    continue
                kind = kind_of(name)
                names.setdefault(kind, set()).add(name)
                sizes = kinds.setdefault(kind, dict.fromkeys(PRECISIONS, 0))
                sizes[FLOAT] += math.prod(shape) * size
                for bits in (8, 4):
                    sizes[bits] += packed_bytes(shape[0], shape[1], bits, group_size)
    return CheckpointSizes(kinds, names, fixed)


class PlanError(ValueError):
    pass


def check_budget(sizes: dict[str, dict[int | None, int]], fixed_bytes: int, max_bytes: int) -> None:
    """PlanError naming the smallest total where even every kind at int4 does not fit."""
    smallest = fixed_bytes + sum(min(options.values()) for options in sizes.values())
    if smallest > max_bytes:
        raise PlanError(f"max bytes {max_bytes:,} is below the smallest plan, every kind at int4: {smallest:,} bytes")


def choose_plan(sizes: dict[str, dict[int | None, int]], sensitivity: dict[str, dict[int, float]],
                fixed_bytes: int, max_bytes: int) -> dict[str, int | None]:
    """Each kind's precision (FLOAT, 8 or 4) minimising the summed sensitivity subject to
    fixed_bytes + the kinds' bytes <= max_bytes; sensitivity: kind -> {8: ..., 4: ...} (float
    costs 0). Among plans of equal summed sensitivity the one of the most bytes (the most
    precision: all float when it fits), then the first in kind order with PRECISIONS' order.
    Exhaustive (3^kinds plans, 59,049 at the 10 kinds a model has at most): exact, so more
    budget never gives a higher sum. PlanError naming the smallest total when even all-int4
    does not fit."""
    check_budget(sizes, fixed_bytes, max_bytes)
    kinds = sorted(sizes)
    cost = [{bits: 0.0 if bits is FLOAT else sensitivity[k][bits] for bits in PRECISIONS} for k in kinds]
    best, best_key = None, None
    for choice in itertools.product(PRECISIONS, repeat=len(kinds)):
        total = fixed_bytes + sum(sizes[k][bits] for k, bits in zip(kinds, choice))
        if total > max_bytes:
            continue
        key = (math.fsum(c[bits] for c, bits in zip(cost, choice)), -total)
        if best_key is None or key < best_key:             # strict: the first of equals stays
            best, best_key = choice, key
    return dict(zip(kinds, best))
