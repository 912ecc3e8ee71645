"""The HTTP handlers' side of the EngineLoop: submit a request's choices, await their outputs.

Each prompt is one engine request whose SamplingParams.n samples are its choices; choices are
numbered prompt-major (choice index = the choices of the earlier prompts + sample index),
and each is awaited on its own, as a one-completion RequestOutput. The loop thread hands its outputs to this asyncio loop
through call_soon_threadsafe, so a handler awaits a queue and never blocks the event loop.
Closing a Generation (a finished response, an error, a client that went away) aborts every
choice still running, which frees its memory at the loop's next turn.

Latency metrics are observed here, as the outputs reach the server: time to first token and
end-to-end from submission, inter-token time per token between two deltas.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from dataclasses import dataclass

from hybrid_engine.sampling_params import SamplingParams

from .errors import APIError
from .metrics import ServerMetrics


@dataclass
class PromptRequest:
    prompt: list[int]
    params: SamplingParams   # params.n: the choices of this prompt


class EngineClient:
    def __init__(self, engine_loop, metrics: ServerMetrics, max_pending_requests: int):
        self.engine_loop = engine_loop
        self.engine = engine_loop.engine
        self.metrics = metrics
        self.max_pending_requests = max_pending_requests
        self.num_pending = 0     # choices this server has open (event-loop thread only)

    def generate(self, requests: list[PromptRequest], request_id: str) -> Generation:
        """Submits every prompt's request, or none: a ValueError from the engine's validation
        (naming the field) closes the ones already submitted and propagates."""
        num_choices = sum(r.params.n for r in requests)
        if self.num_pending + num_choices > self.max_pending_requests:
            raise APIError(503, f"the server is overloaded: {self.num_pending} requests are in flight "
                                f"(at most {self.max_pending_requests}); retry later")
        return Generation(self, requests, request_id)


class Generation:
    """Async iterator over (choice index, RequestOutput of that choice alone) until every choice
    has finished."""

    def __init__(self, client: EngineClient, requests: list[PromptRequest], request_id: str):
        self.client = client
        self.queue: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        self.streams, self.closed = [], False
        self.start = time.monotonic()
        self.num_choices = sum(r.params.n for r in requests)
        self.last_time = [None] * self.num_choices
        self.done = [False] * self.num_choices
        self.num_held = 0                # choices submitted, counted in client.num_pending
        self.num_finished = 0
        self._split: deque = deque()     # one engine output's choices not yet handed out
        try:
            first = 0
            for i, r in enumerate(requests):
                deliver = _deliverer(aio, self.queue, first)
                self.streams.append(client.engine_loop.submit(r.prompt, r.params, f"{request_id}-{i}", deliver))
                client.num_pending += r.params.n
                self.num_held += r.params.n
                first += r.params.n
        except BaseException:
            self.close()
            raise

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._split:
            if self.num_finished == self.num_choices:
                raise StopAsyncIteration
            first, out = await self.queue.get()
            if isinstance(out, BaseException):
                raise out
            if getattr(out, "error", None):
                raise RuntimeError(out.error)
            for c in out.outputs:
                # A finished request's output repeats the choices that finished before it.
                if not self.done[first + c.index]:
                    self._split.append((first + c.index, dataclasses.replace(out, outputs=[c], finished=c.finished)))
        index, out = self._split.popleft()
        self._observe(index, out)
        if out.finished:
            self.done[index] = True
            self.num_finished += 1
        return index, out

    def _observe(self, index: int, out) -> None:
        now, m = time.monotonic(), self.client.metrics
        if out.new_token_ids:
            last = self.last_time[index]
            if last is None:
                m.observe_first_token(now - self.start)
            else:
                m.observe_inter_token(now - last, len(out.new_token_ids))
            self.last_time[index] = now
        if out.finished:
            # A prompt's tokens are counted once, with its first choice.
            m.observe_finished(out, now - self.start, out.outputs[0].index == 0)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for stream in self.streams:
            stream.close()      # aborts the request unless it has finished
        self.client.num_pending -= self.num_held


def _deliverer(aio: asyncio.AbstractEventLoop, queue: asyncio.Queue, first: int):
    """on_output for the loop thread: must not block, and must not fail once the HTTP side
    has gone (its event loop closed at shutdown)."""
    def deliver(output) -> None:
        try:
            aio.call_soon_threadsafe(queue.put_nowait, (first, output))
        except RuntimeError:
            pass
    return deliver
