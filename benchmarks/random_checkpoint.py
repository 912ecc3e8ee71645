"""Random-weight checkpoints at real model dimensions, for benchmarks (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path

# Qwen3.5-0.8B text dimensions (QWEN35_REFERENCE.md §1.4): 752M parameters, tied embeddings.
QWEN35_08B_CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 24, "full_attention_interval": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "max_position_embeddings": 262144, "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-6, "eos_token_id": 0,
}


def write_random_checkpoint(folder: Path, config: dict, seed: int = 0) -> None:
    """Random weights under the checkpoint names (model.*, mtp.*), drawn tensor by tensor on the
    shapes of a meta-device model (on the current default device, e.g. inside
    `with torch.device("cuda")`): decays from exp(U(log 0.01, log 16)), norms near their
    identity, projections N(0, 0.05^2)."""
    import torch
    from safetensors.torch import save_file

    from hybrid_engine.models import HybridForCausalLM, checkpoint_shapes, parse_config

    with torch.device("meta"):
        model = HybridForCausalLM(parse_config(config), with_mtp=True)
    device = torch.get_default_device()
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, shape in checkpoint_shapes(model).items():
        if name.endswith("A_log"):
            t = torch.empty(shape, device=device).uniform_(0.01, 16, generator=gen).log()
        elif len(shape) == 1:
            t = torch.randn(shape, generator=gen, device=device) * 0.1
            t += 1.0 if name.endswith("linear_attn.norm.weight") else 0.0
        else:
            t = torch.randn(shape, generator=gen, device=device) * 0.05
        state[name if name.startswith("mtp.") else f"model.{name}"] = t.cpu()
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "model.safetensors.tmp"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    (folder / "model.safetensors.tmp").rename(folder / "model.safetensors")
