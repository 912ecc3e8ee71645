"""SamplingParams(n=...): n independent samples of one prompt that share its prefill.

The n samples are n Requests, each with its own sequence, seed, stop checks and cache. The
prompt is prefilled once:
1. sample 0 prefills the prompt but its last token, and samples 1..n-1 wait as its `forks`;
2. then the scheduler forks its cache to each sibling (HybridCacheManager.fork shares its
   prefix-cached blocks, copies the other KV blocks of every attention layer, the MTP layer's
   included, and the committed GDN conv window and recurrent state into the sibling's own
   blocks and slot);
3. every sample then computes the last prompt token itself and samples from its own logits
   row, and from there runs as any request: decode or verify, stops, preemption (a preempted
   sample re-prefills on its own) and finish.
Chosen over sampling the n first tokens from one shared logits row of the whole prompt:
that row would need a sampler call with n seeds and an MTP catch-up with n different next
tokens for one segment, where here each sample goes through the ordinary per-request path,
for n - 1 extra one-token rows in one step. The model computes P - 1 + n prompt tokens,
not n * P. A sibling with no room when the prefix is ready (n > max_num_seqs, or a full
cache) waits and prefills on its own: n never has to fit at once.

Seeds: sample i is keyed by params.child_seed(i) (seed + i, vLLM's), so the samples differ
and each equals a lone request with that seed; unseeded, each draws its own from the
engine's seed source. Ids: sample i of request R runs as f"{R}#sample{i}"; its outputs are
merged back into R's (`merge`), and aborting R aborts all of them.

Request ids, made and checked here for the engine and the engine loop alike: a caller may
choose any str but one of the samples' form, which the engine keeps for itself, so that no
sample can take a caller's id ("0_5", vLLM's form of the child ids, is a plausible id of a
caller's own); automatic ids are numbers, skipping any id in use.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable

from .outputs import CompletionOutput, RequestOutput
from .request import Request

_SAMPLE_ID = re.compile(r".*#sample[0-9]+", re.DOTALL)


def sample_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#sample{index}"


def check_caller_request_id(request_id: str) -> None:
    """ValueError if a caller's id has the form the engine keeps for the n samples' ids."""
    if _SAMPLE_ID.fullmatch(request_id):
        raise ValueError(f"request id {request_id!r} ends in '#sample<number>', the form of the ids the "
                         "engine gives the n samples of a request; choose another")


class AutomaticRequestIds:
    """One engine's automatic request ids: "0", "1", ... skipping any id in use, whoever chose
    it. next() on the count is atomic, so the engine loop may draw ids on callers' threads."""

    def __init__(self):
        self._count = itertools.count()

    def new(self, in_use: Callable[[str], bool]) -> str:
        request_id = str(next(self._count))
        while in_use(request_id):
            request_id = str(next(self._count))
        return request_id


class RequestGroup:
    def __init__(self, request_id: str, samples: list[Request]):
        self.request_id = request_id
        self.samples = samples          # in index order
        for sample in samples:
            sample.group = self
        # Each sample's latest output: a finished group's output lists every completion.
        self._latest: list[CompletionOutput | None] = [None] * len(samples)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.samples)

    def merge(self, outputs: list[RequestOutput]) -> RequestOutput:
        """The samples' outputs of one step (one each at most) -> the group's output for it:
        the completions that advanced, or every completion once all have finished (those
        that did not advance in this step with empty deltas)."""
        for out in outputs:
            completion = out.outputs[0]
            self._latest[completion.index] = completion
        finished = self.finished
        if finished:
            stepped = {out.outputs[0].index for out in outputs}
            completions = [c if i in stepped else dataclasses.replace(c, new_token_ids=[], new_text="")
                           for i, c in enumerate(self._latest)]
        else:
            completions = sorted((out.outputs[0] for out in outputs), key=lambda c: c.index)
        first = outputs[0]
        return RequestOutput(request_id=self.request_id, prompt=first.prompt,
                             prompt_token_ids=first.prompt_token_ids, outputs=completions, finished=finished,
                             num_cached_tokens=first.num_cached_tokens,
                             prompt_logprobs=self.samples[0].prompt_logprobs)   # it scores the shared prompt
