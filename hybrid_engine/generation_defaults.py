"""A model's default sampling parameters, from its folder's generation_config.json.

HF's convention, read as vLLM does (`generation_config="auto"`): the keys temperature, top_p,
top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens) become the defaults of a
request that gives no SamplingParams; any other key (do_sample, eos_token_id, ...) is not a
sampling default and is left alone (vLLM too ignores do_sample). An explicit SamplingParams
replaces the defaults entirely, as in vLLM; the CLI overrides them flag by flag.
"""

from __future__ import annotations

import json
from pathlib import Path

from .sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(folder: str | Path) -> dict[str, object]:
    """SamplingParams field -> value from `folder`/generation_config.json ({} without the file);
    ValueError naming the file and the key when a value is not a valid sampling parameter."""
    path = Path(folder) / FILE_NAME
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    defaults = {field: raw[key] for key, field in KEYS.items() if raw.get(key) is not None}
    for field, value in defaults.items():
        try:
            SamplingParams(**{field: value}).validate(vocab_size=2**31)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return defaults


def describe(defaults: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in defaults.items())
