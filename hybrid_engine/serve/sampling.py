"""HTTP sampling fields -> the engine's SamplingParams, one per choice.

Values are passed through as given: the engine's validation (at submit) names a bad field
in its ValueError, which becomes the 400's message. Only what the engine has no field for is
refused here. A prompt's `n` choices are one engine request with SamplingParams.n: one
prefill, and choice i is sample i, seeded seed + i (SamplingParams.child_seed), so the n
choices differ from each other and the whole response is reproducible.
"""

from __future__ import annotations

from hybrid_engine.sampling_params import SamplingParams

from .errors import APIError
from .protocol import SamplingFields


def prompt_params(req: SamplingFields, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The engine request of one prompt: its n choices are the request's n samples."""
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    return SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=-1 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        max_tokens=max_tokens, min_tokens=req.min_tokens, seed=req.seed, n=req.n,
        stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos, logprobs=logprobs)


def check_fits(prompt_len: int, max_tokens: int | None, max_model_len: int, field: str = "max_tokens") -> int:
    """max_tokens, or all the room left when not given; a request that cannot fit is a 400."""
    room = max_model_len - prompt_len
    if max_tokens is None:
        return room
    if prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt "
                            f"has {prompt_len} and {field} asks for {max_tokens} more", field)
    return max_tokens
