"""The KL divergence of a perplexity run from a base run (llama-perplexity's
--kl-divergence-base workflow): one run, usually float32, saves its distributions at the
scored tokens to a file; a run of the same text with another dtype or quantization reads it
and reports the mean KL(base || run) and how often both runs rank the same token first.

What the file keeps, and why: llama.cpp stores every logit of every scored token (2 bytes x
vocabulary per token: 12 GB for 25k tokens at Qwen3.5's 248k vocabulary). Here each scored
token keeps its base distribution's k most likely tokens and the scored token itself, as
int32 ids and float32 logprobs ((k + 1) x 8 bytes per token: 13 MB for 25k tokens at k = 64),
in a safetensors file whose metadata names the format, --ctx-size and k. The KL is then that
of the two distributions with every token outside S merged into one "rest" token, S being the
tokens both runs list at that position (each lists its own k most likely and the scored
token): KL = sum over S of p (log p - log q) + p_rest (log p_rest - log q_rest). Merging
tokens can only lose information, so this is a lower bound of the full KL, equal to it when
S holds all of both distributions' mass; the report gives the base's mass outside S (the
bound is tight when it is small), and the same-top-token rate is exact (k >= 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .perplexity import ScoredTokens, mean_with_error

FORMAT = "hybrid-engine kl-base"
VERSION = "1"


@dataclass
class KLBase:
    scored: ScoredTokens
    ctx_size: int
    top_k: int
    metadata: dict[str, str]


def save_kl_base(path: str | Path, scored: ScoredTokens, ctx_size: int, top_k: int, **about: str) -> None:
    from safetensors.torch import save_file

    tensors = {"token_ids": scored.token_ids.to(torch.int32), "logprobs": scored.logprobs.float(),
               "top_ids": scored.top_ids.to(torch.int32), "top_logprobs": scored.top_logprobs.float()}
    metadata = {"format": FORMAT, "version": VERSION, "ctx_size": str(ctx_size), "top_k": str(top_k), **about}
    save_file(tensors, str(path), metadata=metadata)


def load_kl_base(path: str | Path) -> KLBase:
    """ValueError naming the file and what is wrong with it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
                raise ValueError(f"{path} is not a KL base file of this version (--save-kl-base writes one)")
            t = {name: f.get_tensor(name) for name in ("token_ids", "logprobs", "top_ids", "top_logprobs")}
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read KL base file {path}: {e}") from None
    n, k = t["token_ids"].shape[0], int(metadata["top_k"])
    if t["logprobs"].shape != (n,) or t["top_ids"].shape != (n, k + 1) or t["top_logprobs"].shape != (n, k + 1):
        raise ValueError(f"{path}: tensor shapes do not match {n} scored tokens with top_k {k}")
    scored = ScoredTokens(t["token_ids"].long(), t["logprobs"].double(), t["top_ids"].long(),
                          t["top_logprobs"].double())
    return KLBase(scored, int(metadata["ctx_size"]), k, metadata)


@dataclass
class KLResult:
    kl: tuple[float, float]              # mean KL(base || run) and its standard error
    same_top: tuple[float, float]        # fraction of tokens whose most likely token agrees, and its error
    base_mass_outside: float             # mean base probability outside S (how far below the full KL)


def _run_at_base(base_ids: torch.Tensor, run_ids: torch.Tensor, run_lp: torch.Tensor) -> torch.Tensor:
    """The run's logprob of each of the base's listed tokens, -inf where the run does not list
    it (or the base's slot is empty, id < 0): [N, base slots]. Rows go a chunk at a time through
    one dense vocabulary-wide row each (at most DENSE_ELEMENTS at once): comparing every base slot
    with every run slot would take N x k x k memory (85 GB at k = 1024 over 10k tokens)."""
    vocab = int(max(base_ids.max(), run_ids.max(), 0)) + 1
    chunk = max(1, DENSE_ELEMENTS // vocab)
    out = torch.empty(base_ids.shape, dtype=run_lp.dtype)
    for start in range(0, base_ids.shape[0], chunk):
        ids, lps = run_ids[start:start + chunk], run_lp[start:start + chunk]
        dense = torch.full((ids.shape[0], vocab), -math.inf, dtype=run_lp.dtype)
        dense.scatter_reduce_(1, ids.clamp(min=0), torch.where(ids >= 0, lps, -math.inf), "amax")
        wanted = base_ids[start:start + chunk]
        out[start:start + chunk] = torch.where(wanted >= 0, dense.gather(1, wanted.clamp(min=0)), -math.inf)
    return out


DENSE_ELEMENTS = 1 << 24


def kl_divergence(base: ScoredTokens, run: ScoredTokens) -> KLResult:
    """Per scored token, KL over S and the rest (module docstring); both runs of the same tokens."""
    base_ids, base_lp, run_ids, run_lp = base.top_ids, base.top_logprobs, run.top_ids, run.top_logprobs
    run_at_base = _run_at_base(base_ids, run_ids, run_lp)
    in_s = run_at_base > -math.inf
    p = torch.where(in_s, base_lp.exp(), 0.0)
    q = torch.where(in_s, run_at_base.exp(), 0.0)
    inside = torch.where(in_s, p * (base_lp - run_at_base), 0.0).sum(-1)
    p_rest = (1 - p.sum(-1)).clamp(min=0.0)
    q_rest = (1 - q.sum(-1)).clamp(min=1e-30)       # rounding may leave a hair below 0
    rest = torch.where(p_rest > 0, p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()), 0.0)
    kl = inside + rest
    same = (base_ids.gather(1, base_lp.argmax(-1, keepdim=True)) == run_ids.gather(1, run_lp.argmax(-1, keepdim=True)))
    same_rate, _ = mean_with_error(same.squeeze(1).double())
    n = same.shape[0]
    same_error = math.sqrt(same_rate * (1 - same_rate) / (n - 1)) if n > 1 else math.nan
    return KLResult(mean_with_error(kl), (same_rate, same_error), p_rest.mean().item())
