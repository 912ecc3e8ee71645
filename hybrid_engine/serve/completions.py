"""POST /v1/completions: prompts (text, token ids, or a list of either) x n choices.

`echo` puts the prompt before the completion, and with `logprobs` the prompt's tokens come
first in the choice's logprobs too (SamplingParams.prompt_logprobs; the first token's logprob
null, as OpenAI and vLLM): what lm-evaluation-harness's loglikelihood requests read, usually
with max_tokens 0, which echo allows (vLLM's way: the engine generates one token, which is
dropped). Without echo max_tokens 0 is a 400.

app.py runs prepare() on a worker thread, submits the plan's choices, and then awaits
complete() or streams events(); the Generation is app.py's to close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from .engine_client import Choice, EngineClient, Generation
from .errors import APIError
from .logprobs import completion_logprobs
from .protocol import CompletionChoice, CompletionRequest, CompletionResponse, UsageInfo, new_id, now
from .sampling import check_fits, check_prompt_chars, choice_params
from .sse import DONE, event
from .structured import structured_outputs
from .text_stream import StreamedText


@dataclass
class CompletionPlan:
    request_id: str
    choices: list[Choice]         # prompt-major: choice index = prompt index * n + i
    prompt_ids: list[list[int]]   # each prompt's token ids


def prepare(req: CompletionRequest, client: EngineClient) -> CompletionPlan:
    """The engine requests and each prompt's token ids. Bad prompts and parameters raise
    APIError / ValueError (400). Tokenization: CPU work, run on a worker thread (app.py)."""
    for name in ("best_of", "suffix"):
        value = getattr(req, name)
        if value is not None and not (name == "best_of" and value == req.n):
            raise APIError(400, f"{name} is not supported", name)
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1; 0 is allowed only with echo, which returns the prompt "
                            "(and with logprobs its logprobs) alone", "max_tokens")
    prompts = req.prompt
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    constraint = structured_outputs(req)
    engine = client.engine
    for prompt in prompts:
        if isinstance(prompt, str):
            check_prompt_chars(len(prompt), client.prompt_char_limit, engine.max_model_len, "prompt")
    choices, prompt_ids = [], []
    for i, prompt in enumerate(prompts):
        try:
            _, ids = engine.encode_prompt(prompt)
        except ValueError as e:
            raise APIError(400, f"prompt {i}: {e}" if len(prompts) > 1 else str(e), "prompt") from None
        max_tokens = 1 if _echo_only(req) else 16 if req.max_tokens is None else req.max_tokens
        max_tokens = check_fits(len(ids), max_tokens, engine.max_model_len)
        prompt_ids.append(ids)
        prompt_logprobs = req.logprobs if req.echo else None
        for j, params in enumerate(choice_params(req, max_tokens, req.logprobs, client.default_params,
                                                 prompt_logprobs, constraint)):
            choices.append(client.choice(ids, params, counts_prompt=j == 0))
    return CompletionPlan(new_id("cmpl"), choices, prompt_ids)


def _echo_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0: the prompt alone (the one token generated is dropped)."""
    return req.echo and req.max_tokens == 0


def _as_text(client: EngineClient, ids: list[int]) -> str:
    tok = client.engine.tokenizer
    # no tokenizer: the ids, each followed by a space
    return tok.decode(ids) if tok is not None else "".join(f"{t} " for t in ids)


def _text(client: EngineClient, out) -> str:
    return out.text if client.engine.tokenizer is not None else _as_text(client, out.token_ids)


async def complete(req: CompletionRequest, plan: CompletionPlan, gen: Generation, client: EngineClient,
                   model: str) -> CompletionResponse:
    final = await gen.final_outputs()
    tok = client.engine.tokenizer
    echo_only = _echo_only(req)
    result = []
    for index, out in enumerate(final):
        ids, entries, text = [], [], ""
        if req.echo:
            ids = plan.prompt_ids[index // req.n]
            entries, text = out.prompt_logprobs or [], _as_text(client, ids)
        if not echo_only:
            ids, entries, text = ids + out.token_ids, entries + (out.logprobs or []), text + _text(client, out)
        logprobs = None
        if req.logprobs is not None and tok is not None:
            logprobs = completion_logprobs(tok, ids, entries, req.logprobs)
        result.append(CompletionChoice(index=index, text=text, logprobs=logprobs,
                                       finish_reason="length" if echo_only else out.finish_reason,
                                       stop_reason=None if echo_only else out.stop_reason))
    return CompletionResponse(id=plan.request_id, created=now(), model=model, choices=result,
                              usage=_usage(plan.prompt_ids, [] if echo_only else final))


def _usage(prompt_ids: list[list[int]], outputs) -> UsageInfo:
    p = sum(len(ids) for ids in prompt_ids)
    c = sum(len(o.token_ids) for o in outputs if o is not None)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def events(req: CompletionRequest, plan: CompletionPlan, gen: Generation, client: EngineClient,
                 model: str) -> AsyncIterator[str]:
    """The SSE body. Closing the generation is the caller's (app.py), whatever becomes of this."""
    created, tok, rid = now(), client.engine.tokenizer, plan.request_id
    texts = [StreamedText(c.params.stop_strings) for c in plan.choices]
    num_tokens = [0] * len(plan.choices)
    finals = [None] * len(plan.choices)
    echo_only, with_logprobs = _echo_only(req), req.logprobs is not None and tok is not None
    # The prompt's logprobs come with a choice's first output, and its echo with them.
    echo_pending = [req.echo and with_logprobs] * len(plan.choices)

    def chunk(index: int, text: str, logprobs=None, finish=None, stop_reason=None) -> str:
        return event(CompletionResponse(id=rid, created=created, model=model, choices=[
            CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish,
                             stop_reason=stop_reason)]))
    if req.echo and not with_logprobs:
        for index in range(len(plan.choices)):
            yield chunk(index, _as_text(client, plan.prompt_ids[index // req.n]))
    async for index, out in gen:
        if echo_pending[index]:
            echo_pending[index] = False
            ids = plan.prompt_ids[index // req.n]
            yield chunk(index, _as_text(client, ids), completion_logprobs(tok, ids, out.prompt_logprobs or [],
                                                                           req.logprobs))
        if echo_only:
            if out.finished:
                yield chunk(index, "", None, "length")
            continue
        if tok is None:
            text = _as_text(client, out.new_token_ids)
        else:
            text = texts[index].delta(out.text, out.finished)
        logprobs = None
        if with_logprobs and out.new_token_ids:
            new = out.token_ids[num_tokens[index]:]
            logprobs = completion_logprobs(tok, new, out.logprobs[num_tokens[index]:], req.logprobs)
        num_tokens[index] = len(out.token_ids)
        if out.finished:
            finals[index] = out
        if text or logprobs or out.finished:
            yield chunk(index, text, logprobs, out.finish_reason, out.stop_reason)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield event(CompletionResponse(id=rid, created=created, model=model, choices=[],
                                       usage=_usage(plan.prompt_ids, [] if echo_only else finals)))
    yield DONE
