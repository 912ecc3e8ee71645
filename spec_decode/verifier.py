"""Acceptance of drafts against the target's logits at the k+1 verified positions.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
target's token at the first mismatch (or after the last draft). Sampling: sample every
position with the request's full sampler chain (penalties, min_tokens bans, top-k/p,
min-p, its seed), with the history extended by the tokens accepted so far, and accept
while the sample equals the draft. Each emitted token is then a draw from exactly the
distribution the non-speculative path would use at that point, so output is lossless for
any sampler (the rule llama.cpp uses), at the cost of up to k+1 sampler calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybrid_engine.sampler import Sampler, SamplingRow


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens: argmax at each of the k+1 positions -> the emitted tokens (1..k+1)."""
    emitted = []
    for j, tok in enumerate(target_tokens):
        emitted.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return emitted


def accept_by_sampling(sampler: Sampler, logits: torch.Tensor, drafts: list[int],
                       row_for: Callable[[list[int]], SamplingRow]
                       ) -> tuple[list[int], list[dict[int, float] | None]]:
    """logits [k+1, V]; row_for(emitted_so_far) builds the SamplingRow for the next position."""
    emitted, logprobs = [], []
    for j in range(logits.shape[0]):
        out = sampler(logits[j:j + 1], [row_for(emitted)])
        tok = out.token_ids[0]
        emitted.append(tok)
        logprobs.append(out.logprobs[0])
        if j == len(drafts) or tok != drafts[j]:
            break
    return emitted, logprobs
