"""The model LLM() uses when none is given: the embedded default model shipped in the package.

A tiny Qwen3.5 hybrid LM (qwen3_5_text: GDN layers with full attention every 4th, an MTP head)
with its byte-level BPE tokenizer, trained on the Python standard library's source by
examples/train_default_model.py. It lives in hybrid_engine/assets/default_model/ (config.json,
model.safetensors with model.* and mtp.* tensors, tokenizer files), so the README's main command
runs on a fresh clone with nothing downloaded.

The MTP head (mtp.* only; every model.* tensor is unchanged) was then self-distilled by
examples/distill_mtp_head.py: 300 steps on the main model's own greedy continuations of 2048
training-split prompts (393k tokens). Held-out corpus prompts, k=2 mean accept length 2.40 -> 2.59
(draft 1 accepted 0.78 -> 0.86); `hybrid-engine bench` mean accept length k=1/2/3
1.76/2.36/2.77 -> 1.88/2.62/3.34.
"""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The packaged default model folder."""
    return Path(__file__).parent / "assets" / "default_model"


def resolve_model(config) -> None:
    """An engine config's model where it names none: the packaged default model (set in place)."""
    if config.model is None:
        config.model = str(default_model_path())
