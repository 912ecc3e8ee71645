"""What the quantized-checkpoint tests share: an engine on a tiny checkpoint, its greedy runs,
broken copies of a checkpoint, FP8 block quantization as Qwen's FP8 releases store it,
asymmetric codes for the formats with zero points, and stored-quantized copies of a float
checkpoint in each format beside a float copy of their dequantized weights."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.checkpoint_formats import fp8
from hybrid_engine.checkpoint_formats.compressed_tensors import pack_int32
from hybrid_engine.checkpoint_formats.int32_fields import pack_fields
from hybrid_engine.kernels.linear.quantized import quantize
from hybrid_engine.quantization import Quantization
from hybrid_engine.quantize_checkpoint import quantized_names, write_checkpoint

PROMPTS = [[(7 * i + 3) % 200 + 1 for i in range(14)], [(5 * i) % 190 + 2 for i in range(23)], [11, 12]]


def mtp_engine(model, backend: str = "auto", **config) -> LLMEngine:
    """float32, small blocks and batches (chunked prefill), MTP k=2."""
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=24, kernel_backend=backend,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **config))


def greedy_runs(engine: LLMEngine, prompts=PROMPTS, max_tokens: int = 12) -> list:
    """The prompts at once, greedy -> (token ids, their logprobs) per prompt."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=f"r{i}")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [(done[r].token_ids, [lp[t] for lp, t in zip(done[r].logprobs, done[r].token_ids)]) for r in sorted(done)]


def broken_copy(src: Path, dst: Path, config_edit=None, tensors_edit=None) -> Path:
    """A copy of the checkpoint `src` with its quantization_config and / or tensors edited."""
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensors_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensors_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def to_fp8(w: torch.Tensor, block: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (float8_e4m3 values, weight_scale_inv [ceil(out/b), ceil(in/b)]): per block scale
    max|w| / 448, as Qwen's FP8 releases hold them."""
    rows, cols = w.shape
    br, bc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.nn.functional.pad(w.float(), (0, bc * block - cols, 0, br * block - rows))
    amax = padded.reshape(br, block, bc, block).abs().amax(dim=(1, 3))
    scale = (amax / 448).to(scale_dtype)
    expanded = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return (w.float() / expanded).to(torch.float8_e4m3fn), scale


def asymmetric_codes(w: torch.Tensor, bits: int, group: int, seed: int, lowest_zero: int = 0):
    """w [N, K] -> (codes, zero points, scales) of asymmetric quantization, W ~ (code - zero) *
    scale: codes int64 [N, K] and zero points int64 [N, K / group] in [0, 2^bits - 1], scales
    float16 [N, K / group]. Each group's scale is its min-max one widened at random by up to 2x,
    and its zero point drawn at random where the group's codes still fit: zero points over
    much of the range, not only near the middle. lowest_zero: GPTQ v1 cannot store 0."""
    g = torch.Generator().manual_seed(seed)
    top = (1 << bits) - 1
    groups = w.float().reshape(w.shape[0], -1, group)
    lo, hi = groups.amin(-1), groups.amax(-1)
    scales = ((hi - lo) / top * (1 + torch.rand(lo.shape, generator=g))).clamp(min=1e-4).half()
    s = scales.float()
    z_min = (-torch.round(lo / s)).clamp(lowest_zero, top)
    z_max = torch.maximum(z_min, (top - torch.round(hi / s)).clamp(max=top))
    zeros = z_min + torch.floor(torch.rand(lo.shape, generator=g) * (z_max - z_min + 1)).clamp(max=z_max - z_min)
    codes = (torch.round(groups / s[..., None]) + zeros[..., None]).clamp(0, top)
    return codes.reshape(w.shape).long(), zeros.long(), scales


def asymmetric_dequantized(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """The float32 weight asymmetric codes stand for: (code - zero) * scale."""
    return (codes - zeros.repeat_interleave(group, 1)).float() * scales.float().repeat_interleave(group, 1)


def dequantized_copy(src: Path, dst: Path, bits_of, group: int) -> Path:
    """A copy of the float checkpoint `src` whose tensors `bits_of(name)` gives bits for (None:
    kept as stored) hold their values quantized at those bits and dequantized, in their own
    dtype (rows are quantized one by one, so a merged or grouped tensor quantizes as its parts do)."""
    from hybrid_engine.kernels.linear.quantized import dequantize, quantize
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if (bits := bits_of(name)) is not None:
            tensors[name] = dequantize(quantize(t, bits, group)).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_asymmetric_pair(src: Path, ct_dir: Path, float_dir: Path, bits: int, group: int) -> None:
    """A compressed-tensors checkpoint of `src` with zero points (symmetric: false) and a float
    copy of its dequantized weights: the projections `hybrid-engine quantize` quantizes, each
    coded asymmetrically with random zero points (compressed-tensors' signed codes: each code
    and zero point less 2^(bits-1), the zero points packed along the output dimension)."""
    # every projection at `bits` (the lm_head too: one config group), MoE experts left float
    wanted = [n for n in quantized_names(src, Quantization(f"int{bits}", group)) if ".experts." not in n]
    names = write_checkpoint(src, ct_dir, dict.fromkeys(wanted, bits), group)
    source, tensors = load_file(str(src / "model.safetensors")), load_file(str(ct_dir / "model.safetensors"))
    dequantized = dict(source)
    middle = 1 << (bits - 1)
    for seed, key in enumerate(sorted(names)):
        base = key.removesuffix(".weight")
        codes, zeros, scales = asymmetric_codes(source[key], bits, group, seed)
        tensors[f"{base}.weight_packed"] = pack_int32(codes - middle, bits)
        tensors[f"{base}.weight_scale"] = scales
        tensors[f"{base}.weight_zero_point"] = pack_int32(zeros - middle, bits, dim=0)
        dequantized[key] = asymmetric_dequantized(codes, zeros, scales, group).to(source[key].dtype)
    save_file(tensors, str(ct_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((ct_dir / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    (ct_dir / "config.json").write_text(json.dumps(config))
    shutil.copytree(src, float_dir)
    save_file(dequantized, str(float_dir / "model.safetensors"), metadata={"format": "pt"})


# What Qwen's FP8 releases store in FP8 (PEERS.md): the projections and every expert's, not
# lm_head, mtp.fc, GDN's b / a or the router; Qwen3-Next's grouped in_proj_qkvz stays 16-bit in
# these tests (its FP8 form is not read yet).
FP8_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
               "up_proj", "down_proj")


def save_pair(src: Path, quantized: tuple[Path, dict, dict], floats: tuple[Path, dict]) -> None:
    """A stored-quantized copy of `src` and its float twin: quantized = (folder, tensors, its
    quantization_config), floats = (folder, tensors); both with `src`'s config.json."""
    config = json.loads((src / "config.json").read_text())
    for folder, tensors, extra in ((*quantized[:2], {"quantization_config": quantized[2]}), (*floats, {})):
        folder.mkdir()
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        (folder / "config.json").write_text(json.dumps({**config, **extra}))


def _is_fp8(name: str) -> bool:
    module = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and module in FP8_MODULES


def write_fp8_pair(src: Path, fp8_dir: Path, float_dir: Path, block: int, scale_dtype: torch.dtype,
                   language_model_prefix: bool = False) -> set[str]:
    """An FP8 copy of `src` and a float copy of its dequantized values; -> the FP8 projections'
    internal names (without `.weight`)."""
    tensors = load_file(str(src / "model.safetensors"))
    as_fp8, dequantized, names = {}, {}, set()
    for name, t in tensors.items():
        stored = name.replace("model.", "model.language_model.", 1) if language_model_prefix else name
        if _is_fp8(name):
            values, scale = to_fp8(t, block, scale_dtype)
            base = stored.removesuffix(".weight")
            as_fp8[f"{base}.weight"], as_fp8[f"{base}.weight_scale_inv"] = values, scale
            rows, cols = t.shape
            expanded = scale.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
            dequantized[name] = values.float() * expanded
            names.add(name.removeprefix("model.").removesuffix(".weight"))
        else:
            as_fp8[stored] = dequantized[name] = t
    save_pair(src, (fp8_dir, as_fp8, fp8.quantization_config((block, block), ["lm_head", "mtp.fc"])),
              (float_dir, dequantized))
    return names


# GPTQ releases quantize the projections, each MoE expert's too; lm_head, the embeddings, GDN's
# b / a, mtp.fc and the router stay 16-bit
GPTQ_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                "up_proj", "down_proj")


def _is_gptq(name: str) -> bool:
    module = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and module in GPTQ_MODULES


def write_gptq_pair(src: Path, gptq_dir: Path, float_dir: Path, bits: int, group: int, desc_act: bool,
                    version: str = "gptq", sym: bool = True) -> None:
    """A GPTQ copy of `src` and a float copy of its dequantized values. With desc_act each input
    width gets one random column order (projections that read the same input share it, as
    GPTQ's order comes from that input's statistics). sym=False: random zero points (at least
    1 for v1, which stores each less one)."""
    tensors = load_file(str(src / "model.safetensors"))
    orders: dict[int, torch.Tensor] = {}
    as_gptq, dequantized = {}, {}
    middle = 1 << (bits - 1)
    for name, w in tensors.items():
        if not _is_gptq(name) or w.shape[1] % group:          # (a width the group does not divide: 16-bit)
            as_gptq[name] = dequantized[name] = w
            continue
        out, cols = w.shape
        order = orders.setdefault(cols, torch.randperm(cols, generator=torch.Generator().manual_seed(cols))
                                  if desc_act else torch.arange(cols))
        if sym:                                                    # groups over the ordered columns
            qw = quantize(w[:, order], bits, group)
            codes, scales = qw.values.to(torch.int64) + middle, qw.scales
            zeros = torch.full(scales.shape, middle)
        else:
            codes, zeros, scales = asymmetric_codes(w[:, order], bits, group, seed=len(as_gptq),
                                                    lowest_zero=1 if version == "gptq" else 0)
        stored = torch.empty_like(codes).index_copy_(1, order, codes)            # back in stored order
        g_idx = torch.empty(cols, dtype=torch.int32).index_copy_(
            0, order, (torch.arange(cols) // group).to(torch.int32))
        base = name.removesuffix(".weight")
        as_gptq[f"{base}.qweight"] = pack_fields(stored.t(), bits, dim=0)
        as_gptq[f"{base}.qzeros"] = pack_fields(zeros.t() - (1 if version == "gptq" else 0), bits, dim=1)
        as_gptq[f"{base}.scales"] = scales.t().contiguous()
        as_gptq[f"{base}.g_idx"] = g_idx
        values = asymmetric_dequantized(codes, zeros, scales, group)
        dequantized[name] = torch.empty_like(w).index_copy_(1, order, values)
    save_pair(src, (gptq_dir, as_gptq, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                        "desc_act": desc_act, "sym": sym, "checkpoint_format": version}),
              (float_dir, dequantized))
