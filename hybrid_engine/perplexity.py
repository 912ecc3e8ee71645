"""Perplexity by llama-perplexity's method, through the LLM API's prompt_logprobs.

The text's tokens are cut into non-overlapping windows of ctx tokens (the rest, less than a
window, is dropped); in each window the tokens at positions ctx/2 + 1 .. ctx - 1 are scored,
each predicted from the tokens before it in its window, so every scored token has at least
ctx/2 tokens of context (llama.cpp's perplexity.cpp: `first = n_ctx/2`, n_ctx - 1 - first
tokens per window). PPL = exp(mean NLL), with llama.cpp's standard error: the NLLs' standard
deviation over sqrt(count - 1), times PPL (the delta method). Each window is one request with
SamplingParams(prompt_logprobs=k, max_tokens=1): the engine's own path, whatever its model,
dtype or kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .sampling_params import SamplingParams


@dataclass
class ScoredTokens:
    """The scored tokens of a run, in text order: each one's id and logprob, and with k > 0 the
    entries of its position ({token: logprob} of the k most likely and itself) as [N, k + 1]
    tensors, padded with id -1 and logprob -inf where the token is among the k."""

    token_ids: torch.Tensor          # [N] int64
    logprobs: torch.Tensor           # [N] float64
    top_ids: torch.Tensor | None = None        # [N, k + 1] int64
    top_logprobs: torch.Tensor | None = None   # [N, k + 1] float64


def split_windows(token_ids: list[int], ctx: int, max_windows: int | None = None) -> list[list[int]]:
    n = len(token_ids) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    return [token_ids[i * ctx:(i + 1) * ctx] for i in range(n)]


def first_scored(ctx: int) -> int:
    """The position of a window's first scored token."""
    return ctx // 2 + 1


def scored_token_ids(windows: list[list[int]]) -> list[int]:
    return [t for w in windows for t in w[first_scored(len(w)):]]


def score_windows(llm, windows: list[list[int]], top_k: int, batch: int,
                  on_window: Callable[[int, torch.Tensor], None] | None = None) -> ScoredTokens:
    """Scores `windows` `batch` at a time (so that only a batch's prompt logprobs are held);
    on_window(i, its NLLs) after each."""
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_k)
    ids, logprobs, top_ids, top_logprobs = [], [], [], []
    for at in range(0, len(windows), batch):
        outs = llm.generate(windows[at:at + batch], params, use_tqdm=False)
        for i, (window, out) in enumerate(zip(windows[at:at + batch], outs), start=at):
            first = first_scored(len(window))
            targets, entries = window[first:], out.prompt_logprobs[first:]
            window_logprobs = torch.tensor([e[t] for e, t in zip(entries, targets)], dtype=torch.float64)
            ids.extend(targets)
            logprobs.append(window_logprobs)
            if top_k:
                width = top_k + 1
                top_ids.extend(list(e) + [-1] * (width - len(e)) for e in entries)
                top_logprobs.extend(list(e.values()) + [-math.inf] * (width - len(e)) for e in entries)
            if on_window is not None:
                on_window(i, -window_logprobs)
    return ScoredTokens(torch.tensor(ids, dtype=torch.int64), torch.cat(logprobs),
                        torch.tensor(top_ids, dtype=torch.int64) if top_k else None,
                        torch.tensor(top_logprobs, dtype=torch.float64) if top_k else None)


def mean_with_error(values: torch.Tensor) -> tuple[float, float]:
    """The mean and llama.cpp's standard error of it: sqrt((mean of squares - mean^2) / (n - 1));
    nan for fewer than 2 values."""
    values = values.double()
    mean = values.mean().item()
    if values.numel() < 2:
        return mean, math.nan
    variance = max((values * values).mean().item() - mean * mean, 0.0)
    return mean, math.sqrt(variance / (values.numel() - 1))


def perplexity(logprobs: torch.Tensor) -> tuple[float, float]:
    """-> (PPL, its standard error): exp of the mean NLL, and the mean's error times PPL."""
    nll, error = mean_with_error(-logprobs)
    ppl = math.exp(nll)
    return ppl, error * ppl
