"""POST /v1/chat/completions: messages through the chat template, then reasoning and tool calls
parsed out of each choice's text (chat_output_parser.py; tool_choice.py where tool_choice
forces the calls).

app.py runs prepare() on a worker thread, submits the plan's choices, and then awaits
complete() or streams events(); the Generation is app.py's to close."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from .chat_output_parser import THINK_END, THINK_START, TOOL_START, ChatDeltaParts, ChatOutputParser
from .chat_template import render_chat
from .engine_client import Choice, EngineClient, Generation
from .errors import APIError
from .logprobs import chat_logprobs
from .protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs, ChatCompletionChunk,
                       ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatStreamChoice,
                       FunctionCallDelta, FunctionCallOut, ToolCallDelta, ToolCallOut, UsageInfo, new_id, now)
from .sampling import check_fits, check_prompt_chars, choice_params
from .sse import DONE, event
from .structured import structured_outputs
from .text_stream import StreamedText
from .tool_choice import ForcedCalls, ForcedToolCallParser, forced_calls


@dataclass
class ChatPlan:
    request_id: str
    choices: list[Choice]
    prompt_ids: list[int]
    reasoning: bool
    tools: bool
    starts_in_reasoning: bool
    forced: ForcedCalls | None = None

    def parser(self) -> ChatOutputParser | ForcedToolCallParser:
        if self.forced is not None:
            return self.forced.parser(ChatOutputParser(self.reasoning, False, self.starts_in_reasoning))
        return ChatOutputParser(self.reasoning, self.tools, self.starts_in_reasoning)


def prepare(req: ChatCompletionRequest, client: EngineClient) -> ChatPlan:
    """The chat template and tokenization: CPU work, run on a worker thread (app.py)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: only allowed with logprobs true", "top_logprobs")
    forced = forced_calls(req.tools, req.tool_choice, req.parallel_tool_calls)
    constraint = structured_outputs(req, forced.schema if forced is not None else None)
    engine = client.engine
    prompt = render_chat(engine.tokenizer, req.messages, req.tools, req.chat_template_kwargs, req.add_generation_prompt)
    check_prompt_chars(len(prompt), client.prompt_char_limit, engine.max_model_len, "messages")
    try:
        _, ids = engine.encode_prompt(prompt)
    except ValueError as e:
        raise APIError(400, str(e), "messages") from None
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = check_fits(len(ids), req.max_completion_tokens or req.max_tokens, engine.max_model_len, field)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = choice_params(req, max_tokens, logprobs, client.default_params, structured_outputs=constraint)
    choices = [client.choice(ids, p, counts_prompt=i == 0) for i, p in enumerate(params)]
    vocab = client.vocab
    reasoning = THINK_START in vocab and THINK_END in vocab
    return ChatPlan(new_id("chatcmpl"), choices, ids, reasoning=reasoning,
                    tools=bool(req.tools) and req.tool_choice != "none" and TOOL_START in vocab,
                    starts_in_reasoning=reasoning and prompt.rfind(THINK_START) > prompt.rfind(THINK_END),
                    forced=forced)


def _finish_reason(out, saw_tool_call: bool) -> str | None:
    return "tool_calls" if saw_tool_call and out.finish_reason == "stop" else out.finish_reason


def _usage(plan: ChatPlan, outputs) -> UsageInfo:
    p, c = len(plan.prompt_ids), sum(len(o.token_ids) for o in outputs if o is not None)
    return UsageInfo(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


async def complete(req: ChatCompletionRequest, plan: ChatPlan, gen: Generation, client: EngineClient,
                   model: str) -> ChatCompletionResponse:
    final = await gen.final_outputs()
    tok = client.engine.tokenizer
    result = []
    for index, out in enumerate(final):
        parser = plan.parser()
        parts = [parser.feed(out.text), parser.finish()]
        calls: dict[int, ToolCallOut] = {}
        for piece in (p for part in parts for p in part.tool_calls):
            if piece.id is not None:
                calls[piece.index] = ToolCallOut(id=piece.id, function=FunctionCallOut(name=piece.name, arguments=""))
            calls[piece.index].function.arguments += piece.arguments
        content = "".join(p.content for p in parts)
        reasoning = "".join(p.reasoning for p in parts)
        message = AssistantMessage(content=None if calls and not content.strip() else content,
                                   reasoning_content=reasoning or None, tool_calls=list(calls.values()))
        logprobs = None
        if req.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(tok, out.token_ids, out.logprobs or [],
                                                                req.top_logprobs or 0))
        result.append(ChatChoice(index=index, message=message, logprobs=logprobs,
                                 finish_reason=_finish_reason(out, bool(calls)), stop_reason=out.stop_reason))
    return ChatCompletionResponse(id=plan.request_id, created=now(), model=model, choices=result,
                                  usage=_usage(plan, final))


def _delta(parts: ChatDeltaParts) -> ChatDelta:
    calls = [ToolCallDelta(index=p.index, id=p.id, type="function" if p.id else None,
                           function=FunctionCallDelta(name=p.name, arguments=p.arguments))
             for p in parts.tool_calls]
    return ChatDelta(content=parts.content or None, reasoning_content=parts.reasoning or None,
                     tool_calls=calls or None)


async def events(req: ChatCompletionRequest, plan: ChatPlan, gen: Generation, client: EngineClient,
                 model: str) -> AsyncIterator[str]:
    """The SSE body. Closing the generation is the caller's (app.py), whatever becomes of this."""
    created, tok, rid = now(), client.engine.tokenizer, plan.request_id
    n = len(plan.choices)
    texts = [StreamedText(c.params.stop_strings) for c in plan.choices]
    parsers = [plan.parser() for _ in range(n)]
    saw_call = [False] * n
    num_tokens = [0] * n
    finals = [None] * n

    def chunk(index: int, delta: ChatDelta, logprobs=None, finish=None, stop_reason=None) -> str:
        return event(ChatCompletionChunk(id=rid, created=created, model=model, choices=[ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish, stop_reason=stop_reason)]))
    for index in range(n):
        yield chunk(index, ChatDelta(role="assistant", content=""))
    async for index, out in gen:
        parts = parsers[index].feed(texts[index].delta(out.text, out.finished))
        if out.finished:
            end = parsers[index].finish()
            parts = ChatDeltaParts(parts.reasoning + end.reasoning, parts.content + end.content,
                                   parts.tool_calls + end.tool_calls)
            finals[index] = out
        saw_call[index] |= bool(parts.tool_calls)
        logprobs = None
        if req.logprobs and out.new_token_ids:
            start = num_tokens[index]
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(
                tok, out.token_ids[start:], out.logprobs[start:], req.top_logprobs or 0))
        num_tokens[index] = len(out.token_ids)
        if parts or logprobs:
            yield chunk(index, _delta(parts), logprobs)
        if out.finished:
            yield chunk(index, ChatDelta(), finish=_finish_reason(out, saw_call[index]),
                        stop_reason=out.stop_reason)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield event(ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                        usage=_usage(plan, finals)))
    yield DONE
