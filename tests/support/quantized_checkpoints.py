"""What the quantized-checkpoint tests share: an engine on a tiny checkpoint, its greedy runs,
broken copies of a checkpoint, and FP8 block quantization as Qwen's FP8 releases store it."""

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
