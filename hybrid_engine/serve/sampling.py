"""HTTP sampling fields -> the engine's SamplingParams, one per choice.

Values are passed through as given: the engine's validation (at submit) names a bad field
in its ValueError, which becomes the 400's message. Only what the engine has no field for is
refused here. A sampling field the request leaves out takes the server's default, which the
CLI reads from the model's generation_config.json (LLM.get_default_sampling_params), as
`vllm serve` does; so a request equals LLM.generate with the same fields. `n` choices are n engine requests; with a seed, choice i uses seed + i, so
the n choices differ from each other and the whole response is reproducible.

Checked here before any work: at most MAX_STOP_STRINGS stop strings (the engine's own cap,
sampling_params.py), and a text
prompt far longer than the context can hold is refused before it is tokenized
(prompt_char_limit).
"""

from __future__ import annotations

from dataclasses import replace

from hybrid_engine.sampling_params import MAX_STOP_STRINGS, SamplingParams
from hybrid_engine.structured_outputs import StructuredOutputsParams

from .errors import APIError
from .protocol import SamplingFields


# A normalizer may merge a few characters into one (NFC: a letter and up to three combining
# marks), so a token can stand for up to this many times the characters of its vocab entry.
_CHARS_MERGED = 4

# Request fields that fall back to the server's defaults when not given.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")


def choice_params(req: SamplingFields, max_tokens: int, logprobs: int | None, defaults: SamplingParams,
                  prompt_logprobs: int | None = None,
                  structured_outputs: StructuredOutputsParams | None = None) -> list[SamplingParams]:
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP_STRINGS:
        raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(req.stop)}", "stop")
    given = {name: getattr(req, name) for name in DEFAULTED if getattr(req, name) is not None}
    out = []
    for i in range(req.n):
        out.append(replace(
            defaults, **given, max_tokens=max_tokens, min_tokens=req.min_tokens,
            seed=None if req.seed is None else req.seed + i, stop=req.stop, stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured_outputs))
    return out


def check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str = "max_tokens") -> int:
    """max_tokens, or all the room left when not given; a request that cannot fit is a 400."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt "
                            f"has {prompt_len} and {field} asks for {max_tokens} more", field)
    return max_tokens


def prompt_char_limit(vocab: dict[str, int], max_model_len: int) -> int:
    """The most characters a prompt that fits the context can have. A vocab entry is at least as
    long as the text its token covers (byte-level BPE spells each byte as one character), so no
    token covers more than the longest entry's characters, times what normalizing may merge."""
    longest = max(map(len, vocab), default=1)
    return max_model_len * longest * _CHARS_MERGED


def check_prompt_chars(num_chars: int, limit: int, max_model_len: int, field: str) -> None:
    """Refuses a text far too long for the context without tokenizing it (a 10 MB prompt would
    take a worker thread for seconds, for a 400)."""
    if num_chars > limit:
        raise APIError(400, f"{field}: {num_chars} characters, more than any prompt that fits this model's "
                            f"maximum context length of {max_model_len} tokens can have ({limit})", field)
