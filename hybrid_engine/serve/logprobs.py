"""The engine's per-token logprobs ({token id: logprob}: the N most likely plus the chosen
one, or the prompt's own token for an echoed prompt) in the completion and chat response
formats."""

from __future__ import annotations

from .protocol import ChatLogprob, ChatTokenLogprob, CompletionLogprobs


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float] | None], n: int,
                        text_offset: int = 0) -> CompletionLogprobs:
    """entries: one per token; None for an echoed prompt's first token (nothing predicts it),
    which gets a null logprob and null top_logprobs, as in OpenAI's and vLLM's answers."""
    out = CompletionLogprobs()
    for tok, entry in zip(token_ids, entries):
        piece = tokenizer.decode([tok])
        out.tokens.append(piece)
        out.token_logprobs.append(None if entry is None else entry.get(tok))
        out.top_logprobs.append(None if entry is None else {tokenizer.decode([t]): lp for t, lp in _top(entry, n)})
        out.text_offset.append(text_offset)
        text_offset += len(piece)
    return out


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, float]], n: int) -> list[ChatTokenLogprob]:
    out = []
    for tok, entry in zip(token_ids, entries):
        piece = tokenizer.decode([tok])
        top = [ChatLogprob(token=(p := tokenizer.decode([t])), logprob=lp, bytes=list(p.encode()))
               for t, lp in _top(entry, n)]
        out.append(ChatTokenLogprob(token=piece, logprob=entry[tok],
                                    bytes=list(piece.encode()), top_logprobs=top))
    return out
