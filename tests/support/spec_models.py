"""Tiny checkpoints whose MTP head drafts well enough to be tested (20-80% acceptance).

A random MTP over a random target accepts almost nothing. Here the target is pushed towards
a bigram model: its embedding is scaled up by `embed_scale`, so the residual stream is
dominated by the current token, and its untied lm_head rows are the embedding rows
permuted by a random permutation, so the bigram prediction is a permutation of the token.
The MTP head's fc passes the token-(t+1) embedding through and its decoder layer is damped,
so it drafts exactly that bigram prediction for t+2. The decoder layers of the target move
its prediction away from the bigram, and `embed_scale` sets how often: acceptance is tunable.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from checkpoints import make_hf_model, save_checkpoint


def make_spec_checkpoint(folder: Path, family: str = "qwen3_5", embed_scale: float = 3.0, seed: int = 0,
                         **overrides) -> Path:
    hf = make_hf_model(family, seed=seed, tie_word_embeddings=False, **overrides)
    g = torch.Generator().manual_seed(seed + 17)
    with torch.no_grad():
        emb = hf.model.embed_tokens.weight
        perm = torch.randperm(emb.shape[0], generator=g)
        hf.lm_head.weight.copy_(emb[perm])
        emb.mul_(embed_scale)
    save_checkpoint(hf, folder, add_mtp=True)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(str(path))
    h = hf.config.hidden_size
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)
    tensors["mtp.fc.weight"] = fc + 0.01 * torch.randn(h, 2 * h, generator=g)
    for name in list(tensors):
        if name.startswith("mtp.") and ("norm" in name or "layernorm" in name):
            tensors[name] = torch.zeros_like(tensors[name])
        elif name.startswith("mtp.layers.0.") and (name.endswith("o_proj.weight") or "down_proj" in name):
            tensors[name] = tensors[name] * 0.05
    save_file(tensors, str(path), metadata={"format": "pt"})
    return Path(folder)
