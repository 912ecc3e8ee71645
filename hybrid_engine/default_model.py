"""The model LLM() uses when none is given.

Until the trained embedded model ships, this is a tiny random-weight Qwen3.5 checkpoint
(dense, GDN layers with full attention every 4th, an MTP head) written once to a cache
folder, so the README's main command runs on a fresh clone with nothing downloaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

TINY_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 4, "full_attention_interval": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "max_position_embeddings": 4096, "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-6, "eos_token_id": 0,
}


def default_model_path() -> Path:
    root = Path(os.environ.get("HYBRID_ENGINE_CACHE", Path.home() / ".cache" / "hybrid-engine"))
    folder = root / "tiny-random-qwen3_5"
    if not (folder / "model.safetensors").exists():
        write_random_checkpoint(folder, TINY_CONFIG, seed=0)
    return folder


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> None:
    from safetensors.torch import save_file

    from hybrid_engine.models import HybridForCausalLM, parse_config

    torch.manual_seed(seed)
    model = HybridForCausalLM(parse_config(config), with_mtp=True)
    state = {}
    for name, p in model.state_dict().items():
        if name.endswith("A_log"):
            p = torch.empty_like(p).uniform_(0.01, 16).log()
        elif p.dim() == 1:
            p = torch.randn_like(p) * 0.1 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0)
        else:
            p = torch.randn_like(p) * 0.05
        state[name if name.startswith("mtp.") else f"model.{name}"] = p.contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(folder / "model.safetensors")
