"""`hybrid-engine quantize SRC DST`: a float checkpoint written as a compressed-tensors
pack-quantized one (hybrid_engine/checkpoint_formats/compressed_tensors.py), which loads here
(and in vLLM) without quantizing at every start.

The projections quantized are the ones online quantization quantizes (hybrid_engine/
quantization.py: the same rule, the same values, an untied lm_head at int8 under int4 in a
config group of its own), with one exception: a tied lm_head stays float with its embedding
table, as in community int4 checkpoints (its own quantized copy would be a second table on
disk). MoE experts are written per expert, as vLLM reads compressed-tensors MoE checkpoints
(`mlp.experts.{e}.gate_proj.weight_packed`, `.up_proj.`, `.down_proj.`): experts stored fused
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) are split. Every other tensor is copied
as stored; each output file holds what its input file held, and the index (if any) follows. The
`ignore` list names every projection left float (GDN's in_proj_b / in_proj_a, mtp.fc, the MoE
router and shared-expert gate, and any layer whose input width the group size does not divide).

`write_checkpoint` is the writer under it, taking each tensor's bits (one config group per bit
width); `write_planned` (`--plan auto`) chooses those bits per kind of projection by measured
sensitivity within a byte budget (quantization_plan.py, sensitivity.py).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .checkpoint_formats import compressed_tensors, stored_quantization
from .checkpoint_formats.compressed_tensors import PackQuantized
from .kernels.linear import LinearMethod
from .kernels.linear.quantized import QuantizedLinearMethod, quantize
from .kernels.linear.reference import shard_names
from .models.config import CheckpointError, load_config
from .models.linear import Linear
from .models.loader import INDEX_NAME, map_name
from .models.mlp import Experts
from .models.qwen3_5 import HybridForCausalLM
from .quantization import Quantization, QuantizedLayers

PLAN_KEY = "quantization_plan"
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def quantized_names(folder: str | Path, scheme: Quantization) -> set[str]:
    """The internal names (`layers.0.mlp.down_proj.weight`) of the tensors online quantization
    quantizes in this checkpoint's model, less a tied lm_head."""
    cfg = load_config(folder)
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers != 0)
    policy = QuantizedLayers(scheme, LinearMethod(), native=False)
    names = set()
    for name, layer in model.named_modules():
        if isinstance(layer, Experts) and policy(name, layer) is not None:
            names.update(f"{name}.{e}.{proj}.weight" for e in range(layer.num_experts)
                         for proj in EXPERT_PROJECTIONS)
        if not isinstance(layer, Linear) or (name == "lm_head" and cfg.tie_word_embeddings):
            continue
        method = policy(name, layer)
        if isinstance(method, QuantizedLinearMethod):
            names.update(f"{base}.weight" for base, _ in shard_names(layer, name)
                         if base.rpartition(".")[2] not in method.float_shards)
    # Qwen3-Next stores in_proj_qkv and in_proj_z grouped as one in_proj_qkvz (models/loader.py):
    # quantized row by row, it quantizes as its parts do
    names.update(n.replace(".in_proj_qkv.", ".in_proj_qkvz.") for n in list(names)
                 if n.endswith(".in_proj_qkv.weight") and n.replace("_qkv.", "_z.") in names)
    return names


def write_quantized(src: str | Path, dst: str | Path, scheme: Quantization, progress=None) -> list[str]:
    """Writes the quantized copy; -> the checkpoint names of the tensors it quantized.
    progress: wraps the list of tensor names (a progress bar)."""
    bits = dict.fromkeys(quantized_names(src, scheme), scheme.bits)
    return write_checkpoint(src, dst, bits, scheme.group_size, progress)


def write_checkpoint(src: str | Path, dst: str | Path, bits: dict[str, int], group_size: int, progress=None,
                     plan: dict | None = None) -> list[str]:
    """The copy of `src` with each tensor `bits` names (internal names) quantized to its bits, in
    groups of group_size, one config group per bit width (`hybrid-engine quantize --plan`
    mixes int4 and int8); -> the checkpoint names of the tensors it quantized. With nothing to
    quantize it is a float copy, without a quantization_config. plan: kept in config.json
    under PLAN_KEY, beside quantization_config rather than in it, so that it is there for an
    all-float plan too and no reader of quantization_config (vLLM, transformers) meets a key
    it does not know."""
    src, dst = Path(src), Path(dst)
    _check_paths(src, dst)
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {src}")
    dst.mkdir(parents=True, exist_ok=True)
    quantized, kept, weight_map = {}, [], {}
    keys = [(path, key) for path in files for key in _keys(path)]
    out: dict[str, torch.Tensor] = {}
    handle = current = None
    for path, key in (progress(keys) if progress is not None else keys):
        if path != current:                          # one output file per input file, written in turn
            _save(out, dst, current, weight_map)
            current, handle = path, safe_open(str(path), framework="pt")
        tensor = handle.get_tensor(key)
        if map_name(key) in bits:
            out.update(_packed(key.removesuffix(".weight"), tensor, bits[map_name(key)], group_size))
            quantized[key] = bits[map_name(key)]
        elif (per_expert := _fused_experts(key, tensor)) and f"{map_name(per_expert[0][0])}.weight" in bits:
            for base, weight in per_expert:
                at = bits[f"{map_name(base)}.weight"]
                out.update(_packed(base, weight, at, group_size))
                quantized[f"{base}.weight"] = at
        else:
            out[key] = tensor
            if (key.endswith(".weight") and tensor.dim() == 2 and map_name(key) is not None
                    and "embed_tokens" not in key and not key.endswith("norm.weight")):
                kept.append(key.removesuffix(".weight"))
    _save(out, dst, current, weight_map)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_NAME):
            shutil.copy2(f, dst / f.name)
    config = json.loads((src / "config.json").read_text())
    if quantized:
        config["quantization_config"] = compressed_tensors.quantization_config(
            _config_groups(quantized, group_size), kept)
    if plan is not None:
        config[PLAN_KEY] = plan
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (src / INDEX_NAME).is_file():
        index = json.loads((src / INDEX_NAME).read_text())
        index["weight_map"] = weight_map
        (dst / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return list(quantized)


def _config_groups(quantized: dict[str, int], group_size: int) -> list[tuple[PackQuantized, list[str]]]:
    """One group per bit width: a single one targets every Linear (what llm-compressor writes; the
    `ignore` list names the rest), several list their modules by name."""
    widths = sorted(set(quantized.values()))
    if len(widths) == 1:
        return [(PackQuantized(widths[0], group_size), ["Linear"])]
    return [(PackQuantized(b, group_size),
             sorted(key.removesuffix(".weight") for key, kb in quantized.items() if kb == b)) for b in widths]


def _check_paths(src: Path, dst: Path) -> None:
    if stored_quantization(src) is not None:
        raise CheckpointError(f"{src} is stored quantized already")
    if dst.exists() and any(dst.iterdir()):
        raise FileExistsError(f"{dst} exists and is not empty")


def _packed(base: str, weight: torch.Tensor, bits: int, group_size: int) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors of the projection `base` holding `weight`."""
    qw = quantize(weight, bits, group_size)
    return {f"{base}.weight_packed": compressed_tensors.pack_int32(qw.values, bits),
            f"{base}.weight_scale": qw.scales,
            f"{base}.weight_shape": torch.tensor(list(weight.shape), dtype=torch.int32)}


def _fused_experts(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused experts tensor (`<...>.experts.gate_up_proj` [E, 2I, H], gate rows first, or
    `<...>.experts.down_proj` [E, H, I]) -> (checkpoint name of each expert's projection without
    `.weight`, its weight); [] for any other tensor."""
    prefix, _, last = key.rpartition(".")
    if not prefix.endswith(".experts") or last not in ("gate_up_proj", "down_proj") or tensor.dim() != 3:
        return []
    if last == "down_proj":
        return [(f"{prefix}.{e}.down_proj", w) for e, w in enumerate(tensor)]
    return [(f"{prefix}.{e}.{proj}", part) for e, w in enumerate(tensor)
            for proj, part in zip(("gate_proj", "up_proj"), w.chunk(2))]


def _save(tensors: dict[str, torch.Tensor], dst: Path, source: Path | None, weight_map: dict) -> None:
    if source is not None:
        save_file(tensors, str(dst / source.name), metadata={"format": "pt"})
        weight_map.update({name: source.name for name in tensors})
    tensors.clear()


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def write_planned(src: str | Path, dst: str | Path, max_bytes: int, windows: list[list[int]], calibration: str,
                  group_size: int = 32, progress=None, on_run=None) -> dict:
    """`hybrid-engine quantize --plan auto`: measures each kind's sensitivity on the calibration
    token windows (sensitivity.py), chooses each kind's precision within max_bytes
    (quantization_plan.py) and writes the checkpoint with the plan in its config.json (PLAN_KEY);
    -> the plan as written there. calibration: what the windows are, for the record. PlanError
    before any measuring when even every kind at int4 does not fit."""
    from .quantization_plan import FLOAT, check_budget, checkpoint_sizes, choose_plan
    from .sensitivity import TOP_K, UNMEASURED_KINDS, measure_sensitivity

    _check_paths(Path(src), Path(dst))                 # before minutes of measuring, as is the budget
    # MoE experts are no kind of a plan yet (a fused checkpoint's sizes are per layer, not per
    # expert): a plan keeps them as stored
    quantizable = {n for n in quantized_names(src, Quantization("int4", group_size)) if ".experts." not in n}
    sizes = checkpoint_sizes(src, quantizable, group_size)
    check_budget(sizes.kinds, sizes.fixed, max_bytes)
    Path(dst).absolute().parent.mkdir(parents=True, exist_ok=True)     # the copies measured are written there
    kl = measure_sensitivity(src, sizes.names, windows, group_size, Path(dst).absolute().parent, on_run)
    plan = choose_plan(sizes.kinds, kl, sizes.fixed, max_bytes)
    bits = {name: plan[kind] for kind, kind_names in sizes.names.items() if plan[kind] is not FLOAT
            for name in kind_names}
    record = {"method": "auto", "measure": "mean KL(float || the kind alone quantized) of the next-token "
                                           f"distributions, over each run's top {TOP_K} and the rest",
              "not_run": sorted(set(UNMEASURED_KINDS) & set(plan)),          # KL 0: not in the scored forward
              "calibration": calibration, "windows": len(windows), "ctx_size": len(windows[0]),
              "group_size": group_size, "max_bytes": max_bytes, "total_bytes": sizes.total(plan),
              "fixed_bytes": sizes.fixed,
              "kinds": {kind: {"bits": plan[kind], "kl_int4": kl[kind][4], "kl_int8": kl[kind][8],
                               "bytes": sizes.kinds[kind][plan[kind]], "weights": len(sizes.names[kind])}
                        for kind in sorted(plan)}}
    write_checkpoint(src, dst, bits, group_size, progress, plan=record)
    return record
