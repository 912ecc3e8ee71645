"""SamplingParams.prompt_logprobs: each prompt token's logprob given the tokens before it, with
the k most likely tokens at its position (vLLM's), from the forward that prefills the prompt.

The builder marks the rows of each prefill chunk that score a prompt token still missing
(step_inputs.py PromptRows: every position but the prompt's last, once each, even across
chunks and preemptions); after the forward their final-normed hidden rows go through lm_head
here, apart from the sampling rows, so only requests that ask pay for it. Logprobs are of the
raw distribution, log_softmax of the float32 logits, as the sampled tokens' are (sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .sampler import top_logprobs
from .step_inputs import PromptRows

# Rows per lm_head call: a piece's float32 logits hold at most 2**26 values (256 MB; its
# log_softmax as much again), 270 rows at a 248k vocabulary, where a 2048-token chunk at once
# would take 2 GB. Not smaller: each piece reads the whole lm_head weight once.
_PIECE_VALUES = 2**26


def score_prompt_rows(spans: list[PromptRows], hidden: torch.Tensor,
                      logits_of: Callable[[torch.Tensor], torch.Tensor], vocab_size: int
                      ) -> dict[str, list[dict[int, float]]]:
    """-> request id -> the {token: logprob} entries of the prompt tokens its rows score, in
    order. hidden: the step's final-normed hidden rows [T, H]; logits_of: hidden rows ->
    float32 logits (ModelRunner.logits)."""
    targets, counts = [], []
    for span in spans:
        req = span.segment.request
        targets.extend(req.prompt_token_ids[span.first_token:span.first_token + span.num_rows])
        counts.extend([req.params.prompt_logprobs] * span.num_rows)
    chosen = torch.tensor(targets, device=hidden.device)
    entries, at = [], 0
    for index in row_pieces([(span.first_row, span.num_rows) for span in spans], vocab_size, hidden.device):
        n = index.numel()
        logprobs = logits_of(hidden[index]).log_softmax(dim=-1)
        entries.extend(top_logprobs(logprobs, chosen[at:at + n], counts[at:at + n]))
        at += n
    scored, at = {}, 0
    for span in spans:
        scored[span.segment.request.request_id] = entries[at:at + span.num_rows]
        at += span.num_rows
    return scored


def row_pieces(spans: list[tuple[int, int]], vocab_size: int, device) -> list[torch.Tensor]:
    """The hidden rows of (first row, rows) spans, in the pieces lm_head scores them in: what a
    tensor-parallel worker's lm_head repeats (hybrid_engine/tensor_parallel.py)."""
    index = torch.tensor([r for first, n in spans for r in range(first, first + n)], dtype=torch.int64,
                         device=device)
    piece = max(1, _PIECE_VALUES // vocab_size)
    return list(index.split(piece)) if index.numel() else []     # (an empty tensor splits into one piece)
