"""Chat messages (+ tools, + chat_template_kwargs) -> the prompt text, by the model's template."""

from __future__ import annotations

import json

from .errors import APIError
from .protocol import ChatMessage, Tool

# Arguments apply_chat_template takes from the request itself; chat_template_kwargs may not set them.
_RESERVED = {"conversation", "messages", "tools", "tokenize", "add_generation_prompt", "return_dict",
             "chat_template", "documents", "continue_final_message"}


def render_chat(tokenizer, messages: list[ChatMessage], tools: list[Tool] | None,
                kwargs: dict | None, add_generation_prompt: bool = True) -> str:
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "the model has no chat template; use /v1/completions", "messages")
    if not messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    bad = sorted(_RESERVED & set(kwargs or {}))
    if bad:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(bad)}", "chat_template_kwargs")
    for i, m in enumerate(messages):
        # OpenAI's rule: content may be left out only by an assistant message that calls tools.
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            field = f"messages[{i}].content"
            raise APIError(400, f"{field}: required for role {m.role!r} (only an assistant message with "
                                "tool_calls may leave it out or set it to null)", field)
    conversation = [_as_template_message(m) for m in messages]
    tool_dicts = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    try:
        return tokenizer.apply_chat_template(conversation, tools=tool_dicts, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(kwargs or {}))
    except Exception as e:  # the template's own raise_exception, or a jinja error
        raise APIError(400, f"the chat template refused the messages: {e}", "messages") from None


def _as_template_message(m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):
        content = "".join(part.text for part in content)
    out = {"role": m.role, "content": content if content is not None else ""}
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        # HF templates (Qwen's among them) expect the arguments as a mapping
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
    return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
