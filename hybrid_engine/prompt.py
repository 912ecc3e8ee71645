"""A request's prompt, checked once: validated and tokenized where the request enters the
engine (LLMEngine.prepare), then handed on as a PreparedPrompt and never checked again."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from .sampling_params import SamplingParams


@dataclass(frozen=True)
class PreparedPrompt:
    """A prompt and its sampling params as `LLMEngine.prepare` checked them: validated and
    tokenized once, the params a private copy, then handed on (LLM -> EngineLoop -> LLMEngine)
    and never checked again."""

    text: str | None           # the prompt's text (None for a token-id prompt)
    token_ids: list[int]
    params: SamplingParams


def encode_prompt(prompt, tokenizer, vocab_size: int, max_model_len: int) -> tuple[str | None, list[int]]:
    """Validates one prompt (str or list of token ids) -> (text, token ids); ValueError if bad."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:   # the tokenizers would raise a TypeError
            raise ValueError(f"prompt is not valid text: {e.reason} at character {e.start} "
                             f"({prompt[e.start]!r})") from None
        if tokenizer is None:
            raise ValueError("text prompt given but the model folder has no tokenizer; pass token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        if not ids:
            raise ValueError("prompt encodes to no tokens")
        text = prompt
    elif isinstance(prompt, (list, tuple)):
        if not prompt:
            raise ValueError("prompt is empty")
        # numbers.Integral admits numpy ints; bool is an int but never a token id.
        bad = next((i for i, t in enumerate(prompt)
                    if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"a token-id prompt must be a list of ints; item {bad} is "
                             f"{type(prompt[bad]).__name__} {prompt[bad]!r}")
        ids, text = [int(t) for t in prompt], None
    else:
        raise ValueError(f"a prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; the maximum is {max_model_len - 1} "
                         f"(max_model_len {max_model_len})")
    return text, ids
