"""HTTP sampling fields -> the engine's SamplingParams, one per choice.

Values are passed through as given: the engine's validation (at submit) names a bad field
in its ValueError, which becomes the 400's message. Only what the engine has no field for is
refused here. A sampling field the request leaves out takes the server's default, which the
CLI reads from the model's generation_config.json (LLM.get_default_sampling_params), as
`vllm serve` does; so a request equals LLM.generate with the same fields. `n` choices are n engine requests; with a seed, choice i uses seed + i, so
the n choices differ from each other and the whole response is reproducible.

At most MAX_STOP_STRINGS stop strings (limits.py) are taken.
"""

from __future__ import annotations

from dataclasses import replace

from hybrid_engine.sampling_params import SamplingParams

from .errors import APIError
from .limits import MAX_STOP_STRINGS
from .protocol import SamplingFields


# Request fields that fall back to the server's defaults when not given.
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
             "frequency_penalty")


def choice_params(req: SamplingFields, max_tokens: int, logprobs: int | None,
                  defaults: SamplingParams) -> list[SamplingParams]:
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
            ignore_eos=req.ignore_eos, logprobs=logprobs, include_stop_str_in_output=req.include_stop_str_in_output))
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
