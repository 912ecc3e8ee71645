"""Batched sampling: one row of logits per request, each row with its own SamplingParams.

Processing order follows vLLM: penalties on the raw logits, banned tokens -> -inf, then
greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw. Logprobs are taken from
the raw logits, before any of that (vLLM's default).

The draw is keyed by position: the token at output position p of a request with seed s is
the inverse CDF of its final distribution at one uniform u = hash(s, p) (`position_uniform`).
No generator state is carried from step to step, so a request samples the same tokens
whatever shares its batch, wherever its row sits, after a preemption, and whether its
positions are sampled one per step or k+1 at a time by the speculative verifier; and the
uniforms are plain numbers, the same on every device.

The pieces (`apply_penalties`, `mask_banned_tokens`, `processed_probs`,
`sample_from_probs`) work on any [N, V] block with one SamplingRow per row, so
the speculative verifier can flatten [B, T, V] to [B*T, V] with one row per position
(its output_token_ids extended by the drafts before that position where a penalty reads them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from hybrid_engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    seed: int = 0               # the request's (hybrid_engine/engine.py picks one when unseeded)
    position: int = 0           # output position of the token this row samples
    banned_token_ids: list[int] = field(default_factory=list)  # e.g. EOS before min_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row; None where params.logprobs is None


class Sampler:
    def __call__(self, logits: Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        _check_batch(logits, rows)
        raw = logits.float()
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sampled:
            tokens = greedy_tokens(mask_banned_tokens(apply_penalties(raw, rows), rows))
        else:
            probs = processed_probs(raw, rows)
            if len(sampled) == len(rows):
                tokens = sample_from_probs(probs, rows)
            else:
                tokens = greedy_tokens(probs)  # greedy rows: the index of their one-hot
                tokens[sampled] = sample_from_probs(probs[sampled], [rows[i] for i in sampled])
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=_raw_logprobs(raw, tokens, rows))


def sample_from_probs(probs: Tensor, rows: list[SamplingRow]) -> Tensor:
    """One token per row of `probs` [N, V]: the first token whose cumulative probability
    exceeds u * total, u = position_uniform(row.seed, row.position). Exact inverse-CDF
    sampling; the sum runs in float64, so over a 250k vocabulary its rounding moves no
    measurable mass. A token of probability 0 is never chosen: the CDF does not rise there."""
    uniforms = torch.tensor([position_uniform(row.seed, row.position) for row in rows],
                            dtype=torch.float64, device=probs.device)
    cdf = probs.double().cumsum_(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's finaliser (Steele et al. 2014): a bijection of 64-bit ints whose outputs pass
    BigCrush even for consecutive inputs, which positions are."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1 - 2**-52] from (seed, position) alone (a counter-based generator).
    52 bits, not 53: then u * total rounds strictly below total for any total near 1, so the
    inverse CDF never runs past the last token of positive probability."""
    return (_splitmix64(_splitmix64(seed & _MASK64) ^ position) >> 12) * 2.0**-52


def greedy_tokens(logits: Tensor) -> Tensor:
    """argmax over the last dim: the first maximum on ties, a NaN counted as the maximum (as
    torch's argmax). Float32 on CPU: numpy's argmax, one pass without torch's reduction set-up,
    several times faster than torch's max or argmax over the last dim (benchmarks/history/RESULTS_LOG.md).
    Elsewhere max().indices: the same index, faster than argmax over large vocabularies."""
    if _numpy_argmax(logits):
        return torch.from_numpy(logits.numpy().argmax(-1))
    return logits.max(dim=-1).indices


def greedy_token_ids(logits: Tensor) -> list[int]:
    """greedy_tokens as host ints, without a tensor in between (the engine's plain greedy rows:
    a step's last host work before its update, where each op costs several us)."""
    if _numpy_argmax(logits):
        return logits.numpy().argmax(-1).tolist()
    return greedy_tokens(logits).tolist()


def _numpy_argmax(logits: Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32


def apply_penalties(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties.

    Returns a new tensor, or `logits` itself when no row asks for a penalty.
    """
    repetition = [row.params.repetition_penalty for row in rows]
    frequency = [row.params.frequency_penalty for row in rows]
    presence = [row.params.presence_penalty for row in rows]
    if any(r != 1.0 for r in repetition):
        seen = _token_counts([row.prompt_token_ids + row.output_token_ids for row in rows], logits) > 0
        penalty = torch.where(seen, logits.new_tensor(repetition).unsqueeze(1), 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if any(frequency) or any(presence):
        counts = _token_counts([row.output_token_ids for row in rows], logits)
        if any(frequency):
            logits = logits - logits.new_tensor(frequency).unsqueeze(1) * counts
        if any(presence):
            logits = logits - logits.new_tensor(presence).unsqueeze(1) * (counts > 0)
    return logits


def mask_banned_tokens(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """Set each row's banned tokens to -inf; returns `logits` itself when none are banned."""
    row_ids = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
    if not row_ids:
        return logits
    token_ids = [t for row in rows for t in row.banned_token_ids]
    index = (torch.tensor(row_ids, device=logits.device), torch.tensor(token_ids, device=logits.device))
    return logits.index_put(index, logits.new_tensor(float("-inf")))


def processed_probs(logits: Tensor, rows: list[SamplingRow]) -> Tensor:
    """The distribution each row is sampled from [N, V]: after penalties, banned tokens,
    temperature, top-k, top-p and min-p; one-hot at the argmax for greedy rows."""
    _check_batch(logits, rows)
    logits = mask_banned_tokens(apply_penalties(logits.float(), rows), rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if len(sampled) == len(rows):
        return _truncated_softmax(logits, [row.params for row in rows])
    probs = torch.zeros_like(logits).scatter_(1, greedy_tokens(logits).unsqueeze(1), 1.0)
    if sampled:
        probs[sampled] = _truncated_softmax(logits[sampled], [rows[i].params for i in sampled])
    return probs


def _truncated_softmax(logits: Tensor, params: list[SamplingParams]) -> Tensor:
    """softmax(logits / temperature) restricted by top-k, then top-p, then min-p."""
    logits = logits / logits.new_tensor([p.temperature for p in params]).unsqueeze(1)
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k != -1 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    min_p = [p.min_p for p in params]
    if any(min_p):
        # p_i < min_p * p_max  <=>  l_i < l_max + log(min_p); the ratio ignores the
        # renormalisation after top-k/top-p, and log(0) = -inf drops nothing.
        threshold = logits.amax(dim=-1, keepdim=True) + logits.new_tensor(min_p).log().unsqueeze(1)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    return logits.softmax(dim=-1)


def _apply_top_k_top_p(logits: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Keep each row's k best tokens, then the smallest prefix of those (by probability,
    renormalised over the k) whose mass reaches top_p; the best token always stays."""
    vocab_size = logits.shape[-1]
    k = torch.tensor([vocab_size if k == -1 else min(k, vocab_size) for k in top_k], device=logits.device)
    # Nothing past the largest k survives, so a partial topk replaces the full sort (costly
    # over a 150k vocabulary) when every row sets top_k, as Qwen's recommended settings do.
    best_logits, best_ids = logits.topk(int(k.max()), dim=-1)
    rank = torch.arange(best_logits.shape[-1], device=logits.device)
    drop = rank >= k.unsqueeze(1)
    best_logits = best_logits.masked_fill(drop, float("-inf"))
    best_probs = best_logits.softmax(dim=-1)
    mass_before = best_probs.cumsum(dim=-1) - best_probs
    p = logits.new_tensor(top_p).unsqueeze(1)
    # top_p == 1 keeps everything: the rounding in the cumsum must not drop the tail.
    drop |= (mass_before >= p) & (p < 1.0)
    best_logits = best_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, best_ids, best_logits)


def _raw_logprobs(raw: Tensor, tokens: Tensor, rows: list[SamplingRow]) -> list[dict[int, float] | None]:
    """Per row asking for N logprobs: the N most likely tokens plus the chosen one."""
    wanted = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
    result: list[dict[int, float] | None] = [None] * len(rows)
    if not wanted:
        return result
    entries = top_logprobs(raw[wanted].log_softmax(dim=-1), tokens[wanted], [rows[i].params.logprobs for i in wanted])
    for i, entry in zip(wanted, entries):
        result[i] = entry
    return result


def top_logprobs(logprobs: Tensor, chosen: Tensor, counts: list[int]) -> list[dict[int, float]]:
    """{token: logprob} per row of `logprobs` [N, V]: its counts[i] most likely tokens, then
    chosen[i] if not among them (the format of every logprobs output: sampled tokens' and the
    prompt's, hybrid_engine/prompt_logprobs.py)."""
    n = min(max(counts, default=0), logprobs.shape[-1])
    top_values, top_ids = logprobs.topk(n, dim=-1)
    chosen_values = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    entries = []
    for ids, values, token, value, k in zip(top_ids.tolist(), top_values.tolist(), chosen.tolist(),
                                            chosen_values.tolist(), counts):
        entry = dict(zip(ids[:k], values[:k]))
        entry.setdefault(token, value)
        entries.append(entry)
    return entries


def _token_counts(token_lists: list[list[int]], like: Tensor) -> Tensor:
    """[N, V] occurrence counts, in `like`'s dtype and device."""
    vocab_size = like.shape[-1]
    width = max((len(ids) for ids in token_lists), default=0)
    counts = like.new_zeros(len(token_lists), vocab_size + 1)  # column V collects the padding
    if width:
        padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_lists]
        index = torch.tensor(padded, device=like.device)
        counts.scatter_add_(1, index, like.new_ones(index.shape))
    return counts[:, :vocab_size]


def _check_batch(logits: Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits [{len(rows)}, V] for {len(rows)} rows, got {list(logits.shape)}")
