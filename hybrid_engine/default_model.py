"""The model LLM() uses when none is given: the embedded default model shipped in the package.

A tiny Qwen3.5 hybrid LM (qwen3_5_text: GDN layers with full attention every 4th, an MTP head)
with its byte-level BPE tokenizer, trained on the Python standard library's source by
examples/train_default_model.py. It lives in hybrid_engine/assets/default_model/ (config.json,
model.safetensors with model.* and mtp.* tensors, tokenizer files), so the README's main command
runs on a fresh clone with nothing downloaded.
"""

from __future__ import annotations

from pathlib import Path


def default_model_path() -> Path:
    """The packaged default model folder."""
    return Path(__file__).parent / "assets" / "default_model"
