"""Request and response bodies of the OpenAI HTTP API (with vLLM's sampling extras).

Requests are parsed strictly, as OpenAI does: an unknown field is a 400 naming it, and a
value of the wrong JSON type is not coerced ("5" is not an int, 1 is not a bool). Responses
are plain models; `exclude_none` is not used, so every documented field is present.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


# ---- shared ------------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` (extra_body): the engine's StructuredOutputsParams fields."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingFields(_Request):
    """The sampling fields both generation endpoints take."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = Field(default=1, ge=1, le=128)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # What the output must be (serve/structured.py): OpenAI's, vLLM's current and vLLM's older fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    error: ErrorInfo


# ---- /v1/completions ---------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------------

class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True


class ChatLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCallOut(_Response):
    name: str
    arguments: str


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class FunctionCallDelta(_Response):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- models, tokenize, detokenize --------------------------------------------------------------

class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "hybrid-engine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Response):
    prompt: str
