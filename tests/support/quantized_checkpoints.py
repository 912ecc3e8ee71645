"""What the quantized-checkpoint tests share: an engine on a tiny checkpoint, its greedy runs,
broken copies of a checkpoint, FP8 block quantization as Qwen's FP8 releases store it, and
asymmetric codes for the formats with zero points."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from safetensors.torch import load_file, save_file

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams

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
