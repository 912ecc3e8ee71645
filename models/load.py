"""Build a HybridForCausalLM from a local HF folder (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig, load_config
from .loader import load_weights, resolve_dtype
from .qwen3_5 import HybridForCausalLM


def load_model(folder: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               with_mtp: bool = False) -> tuple[HybridForCausalLM, ModelConfig]:
    """with_mtp: keep the checkpoint's MTP head (for speculative decoding). Its `mtp.*` tensors
    are read and checked either way; without it they are dropped after the check, so no MTP
    weights stay resident and the model has no MTP layer (nor, then, its KV pool)."""
    cfg = load_config(folder)
    torch_dtype = resolve_dtype(dtype, cfg)
    # Built on the meta device: the loader's tensors are assigned, nothing is initialised twice.
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=True)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    weights = load_weights(folder, cfg, expected, torch_dtype)
    if not with_mtp or not any(name.startswith("mtp.") for name in weights):
        weights = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
        model.mtp = None
    weights = {n: t.to(device) for n, t in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval(), cfg
