"""Acceptance of drafts against the target's logits at the k+1 verified positions.

Greedy: accept the longest prefix of drafts equal to the target's argmax, then emit the
target's token at the first mismatch (or after the last draft). Sampling: sample every
position j with the request's full sampler chain (penalties, min_tokens bans, top-k/p,
min-p) and the history it has if drafts 1..j are accepted (output + d1..dj), and accept
while the sample equals the draft. A position is only used when every earlier draft was
accepted, i.e. when that history is the true one, so each emitted token is a draw from
exactly the distribution the non-speculative path would use: lossless for any sampler (the
rule llama.cpp uses). All positions of all requests go through one sampler call.

The draw at output position p uses the uniform keyed by (seed, p) (hybrid_engine/sampler.py),
the one a plain decode of that position uses too: a seeded speculative run emits, token for
token, the seeded non-speculative output, for any k.
"""

from __future__ import annotations


def accept_greedy(target_tokens: list[int], drafts: list[int]) -> list[int]:
    """target_tokens: argmax at each of the k+1 positions -> the emitted tokens (1..k+1)."""
    emitted = []
    for j, tok in enumerate(target_tokens):
        emitted.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            break
    return emitted


def accept_sampled(sampled: list[int], drafts: list[int]) -> int:
    """How many tokens to emit, given a token sampled at each of the k+1 positions with the
    history each position has if every earlier draft is accepted: up to and including the
    first position whose sample differs from its draft."""
    for j, tok in enumerate(sampled):
        if j == len(drafts) or tok != drafts[j]:
            return j + 1
    return len(sampled)
