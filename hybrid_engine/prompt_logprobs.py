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
    rows, targets, counts = [], [], []
    for span in spans:
        req = span.segment.request
        rows.extend(range(span.first_row, span.first_row + span.num_rows))
        targets.extend(req.prompt_token_ids[span.first_token:span.first_token + span.num_rows])
        counts.extend([req.params.prompt_logprobs] * span.num_rows)
    index = torch.tensor(rows, device=hidden.device)
    chosen = torch.tensor(targets, device=hidden.device)
    piece = max(1, _PIECE_VALUES // vocab_size)
    entries = []
    for at in range(0, len(rows), piece):
        logprobs = logits_of(hidden[index[at:at + piece]]).log_softmax(dim=-1)
        entries.extend(top_logprobs(logprobs, chosen[at:at + piece], counts[at:at + piece]))
    scored, at = {}, 0
    for span in spans:
        scored[span.segment.request.request_id] = entries[at:at + span.num_rows]
        at += span.num_rows
    return scored
