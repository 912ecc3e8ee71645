"""Build a HybridForCausalLM from a local HF folder (config.json + safetensors)."""

from __future__ import annotations

from pathlib import Path

import torch

from .config import ConfigError, ModelConfig, load_config
from .loader import load_weights, resolve_dtype
from .qwen3_5 import HybridForCausalLM


def load_model(folder: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               with_mtp: bool = False) -> tuple[HybridForCausalLM, ModelConfig]:
    """with_mtp: keep the checkpoint's MTP head (for speculative decoding). Its `mtp.*` tensors
    are read and checked either way (unless config.json's mtp_num_hidden_layers is 0: no head);
    without it they are dropped after the check, so no MTP weights stay resident and the model
    has no MTP layer (nor, then, its KV pool)."""
    cfg = load_config(folder)
    if with_mtp and cfg.mtp_num_hidden_layers == 0:
        raise ConfigError(f"{Path(folder) / 'config.json'} sets mtp_num_hidden_layers 0: the model has no MTP "
                          "head, so it cannot draft for speculative decoding")
    torch_dtype = resolve_dtype(dtype, cfg)
    # Built on the meta device: the loader's tensors are assigned, nothing is initialised twice.
    # mtp_num_hidden_layers 0 says there is no head: any mtp.* tensors are then left unread.
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers != 0)
    expected = {name: p.shape for name, p in model.state_dict().items()}
    weights = load_weights(folder, cfg, expected, torch_dtype)
    if not with_mtp or not any(name.startswith("mtp.") for name in weights):
        weights = {n: t for n, t in weights.items() if not n.startswith("mtp.")}
        model.mtp = None
    weights = {n: t.to(device) for n, t in weights.items()}
    model.load_state_dict(weights, strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval(), cfg
