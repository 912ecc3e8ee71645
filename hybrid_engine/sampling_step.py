"""After the forward: the tokens each segment emits, sampled and verified in one pass over the
step's logits (hybrid_engine/engine.py calls it between the forward and the drafter).

A verify of k drafts samples each of its k+1 positions and accepts while the sample equals the
draft (spec_decode/verifier.py: lossless for any sampler). Greedy rows without penalties,
logprobs or banned tokens skip the sampler (one argmax over all of them); every other row goes
through one sampler call. Rows of requests with a structured-output constraint are masked by
their grammars first (hybrid_engine/request_grammar.py), one mask per verified position.
"""

from __future__ import annotations

import torch

from hybrid_engine.spec_decode.verifier import accept_greedy, accept_sampled

from .request import Request
from .request_grammar import mask_logits
from .sampler import Sampler, SamplingRow, greedy_token_ids
from .sampling_params import SamplingParams
from .step_inputs import StepInputs
from .step_update import SegmentResult


def sample_segments(inputs: StepInputs, logits: torch.Tensor, sampler: Sampler) -> list[SegmentResult]:
    """Tokens emitted per segment: none for a prefill chunk short of the end, one for a
    prefill's end or a plain decode, 1..k+1 for a verify. Greedy segments without penalties,
    logprobs or banned tokens skip the sampler (one argmax over all of their rows); every
    other row is sampled in one sampler call."""
    logits = mask_logits(logits, inputs.sample_spans)
    result, greedy, sampled, rows = {}, [], [], []
    for span in inputs.sample_spans:
        seg, _, n = span
        req = seg.request
        if _is_plain_greedy(req):
            greedy.append(span)
        else:
            drafts = req.draft_token_ids
            rows.extend(_sampling_row(req, drafts[:j]) for j in range(n))
            sampled.append(span)
    if greedy:
        targets, at = greedy_token_ids(_logits_rows(logits, greedy)), 0
        for seg, _, n in greedy:
            # One row (a plain decode, a prefill's end) emits its target whatever the drafts.
            tokens = (targets[at:at + 1] if n == 1
                      else accept_greedy(targets[at:at + n], seg.request.draft_token_ids))
            result[id(seg)] = (tokens, [None] * n)
            at += n
    if sampled:
        block = _logits_rows(logits, sampled)
        _lift_bans_leaving_nothing(block, rows)
        out, at = sampler(block, rows), 0
        for seg, _, n in sampled:
            toks, lps = out.token_ids[at:at + n], out.logprobs[at:at + n]
            m = accept_sampled(toks, seg.request.draft_token_ids) if n > 1 else 1
            result[id(seg)] = (toks[:m], lps[:m])
            at += n
    return [SegmentResult(seg, *result.get(id(seg), ([], []))) for seg in inputs.segments]


def _is_plain_greedy(req: Request) -> bool:
    p = req.params
    return (p.is_greedy and p.logprobs is None and not _has_penalties(p)
            and len(req.output_token_ids) >= p.min_tokens)


def _sampling_row(req: Request, extra: list[int] = ()) -> SamplingRow:
    """`extra`: tokens accepted earlier in the same verify, not yet appended. Only penalties
    read the row's output tokens, so only for them is the history copied with `extra`
    (O(tokens so far) per row)."""
    output = req.output_token_ids
    if extra and _has_penalties(req.params):
        output = output + list(extra)
    banned = []
    if len(req.output_token_ids) + len(extra) < req.params.min_tokens:
        banned = list(req.params.stop_token_ids or [])
        if not req.params.ignore_eos:
            banned += req.eos_token_ids
    return SamplingRow(req.params, req.prompt_token_ids, output, req.sampling_seed,
                       len(req.output_token_ids) + len(extra), banned)


def _lift_bans_leaving_nothing(block: torch.Tensor, rows: list[SamplingRow]) -> None:
    """A constrained row whose grammar allows only tokens min_tokens bans (its end, EOS) keeps
    the grammar: the ban is lifted, as no token could satisfy both."""
    for i, row in enumerate(rows):
        if row.banned_token_ids and row.params.structured_outputs is not None:
            allowed = block[i] > float("-inf")
            allowed[row.banned_token_ids] = False
            if not bool(allowed.any()):
                row.banned_token_ids = []


def _logits_rows(logits: torch.Tensor, spans: list[tuple[object, int, int]]) -> torch.Tensor:
    """The rows of (segment, first row, rows) spans, in order; `logits` itself (no gather) when
    they are all of its rows, as sample_spans are sorted and disjoint."""
    if sum(n for _, _, n in spans) == logits.shape[0]:
        return logits
    index = [row for _, first, n in spans for row in range(first, first + n)]
    return logits[torch.tensor(index, device=logits.device)]


def _has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
