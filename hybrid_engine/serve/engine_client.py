"""The HTTP handlers' side of the EngineLoop: admit a request, submit its choices, await their
outputs; and the server's view of what is in flight (for backpressure, a dead engine, shutdown).

Each choice is one engine request. The loop thread hands its outputs to this asyncio loop
through call_soon_threadsafe, so a handler awaits a queue and never blocks the event loop.
Closing a Generation (a finished response, an error, a client that went away, at any point)
aborts every choice still running, which frees its memory at the loop's next turn; the abort's
output still comes back, and is counted in /metrics (finished_reason "abort", with its tokens).

Latency metrics are observed here, as the outputs reach the server: time to first token and
end-to-end from submission, inter-token time per token between two deltas.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_engine.engine_loop import EngineDeadError
from hybrid_engine.prompt import PreparedPrompt
from hybrid_engine.sampling_params import SamplingParams

from .errors import APIError
from .limits import RETRY_AFTER_SECONDS
from .metrics import ServerMetrics
from .sampling import prompt_char_limit

# How often a dead engine is looked for while requests are in flight.
ENGINE_CHECK_SECONDS = 0.5
# After the drain has failed what was left, how long the responses get to send their ending.
_FAILED_RESPONSES_SECONDS = 1.0


@dataclass
class Choice:
    prompt: PreparedPrompt   # EngineClient.choice's
    counts_prompt: bool      # the first choice of its prompt: its tokens go into the prompt total

    @property
    def params(self) -> SamplingParams:
        return self.prompt.params


class EngineClient:
    def __init__(self, engine_loop, metrics: ServerMetrics, max_waiting_requests: int,
                 default_params: SamplingParams):
        self.engine_loop = engine_loop
        self.default_params = default_params   # for the sampling fields a request leaves out
        self.engine = engine_loop.engine
        self.metrics = metrics
        self.max_pending_requests = self.engine.config.max_num_seqs + max_waiting_requests
        # Event-loop thread only:
        self.num_pending = 0     # engine requests this server has open
        self.live: set[Generation] = set()
        self.admitting = True    # False once shutdown has begun
        self._watch: asyncio.Task | None = None
        self.vocab = self.engine.tokenizer.get_vocab() if self.engine.tokenizer is not None else {}
        self.prompt_char_limit = prompt_char_limit(self.vocab, self.engine.max_model_len)

    def check_admitting(self) -> None:
        if not self.admitting:
            raise APIError(503, "the server is shutting down")
        if self.engine_loop.is_dead:
            raise APIError(503, "the engine has stopped after an internal error; this server cannot serve")

    def choice(self, prompt_ids: list[int], params: SamplingParams, counts_prompt: bool) -> Choice:
        """One engine request, checked by the engine (ValueError naming the problem). Called from
        the handlers' worker thread (app.py), so that none of this runs on the event loop: a
        constrained request's first one builds xgrammar's tables of the vocabulary (0.9 s for
        Qwen3.5's 248k tokens) and each parses its schema or grammar."""
        return Choice(self.engine.prepare(prompt_ids, params), counts_prompt)

    def generate(self, choices: list[Choice], request_id: str, deadline: float | None = None) -> Generation:
        """Submits every choice, or none: a failure closes the ones already submitted and
        propagates. With a deadline (time.monotonic), the generation fails with a 408 when it
        passes."""
        self.check_admitting()
        if self.num_pending + len(choices) > self.max_pending_requests:
            raise APIError(503, f"the server is overloaded: {self.num_pending} requests are in flight "
                                f"(at most {self.max_pending_requests}); retry later",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
        try:
            gen = Generation(self, choices, request_id)
        except EngineDeadError as e:
            raise APIError(503, f"the engine has stopped: {e}") from None
        if deadline is not None:
            gen.fail_at(deadline, APIError(408, "the request ran past its X-Request-Timeout"))
        self._watch_engine()
        return gen

    def _watch_engine(self) -> None:
        if self._watch is None or self._watch.done():
            self._watch = asyncio.get_running_loop().create_task(self._fail_all_if_engine_dies())

    async def _fail_all_if_engine_dies(self) -> None:
        # A dying loop hands every consumer an EngineDeadError; a loop thread that ended
        # without doing so (which the loop's own callers' liveness check allows for) would
        # leave these requests waiting forever.
        while self.live:
            await asyncio.sleep(ENGINE_CHECK_SECONDS)
            if self.engine_loop.is_dead:
                self.fail_all(APIError(500, "the engine stopped after an internal error"))

    def fail_all(self, error: APIError) -> None:
        for gen in list(self.live):
            gen.fail(error)

    async def drain(self, timeout: float, stop_now: Callable[[], bool]) -> None:
        """Shutdown: admits nothing more, lets the requests in flight finish for up to timeout
        seconds (or until stop_now()), then fails the rest with a 503 and gives their responses
        a moment to send that ending."""
        self.admitting = False
        deadline = time.monotonic() + timeout
        while self.live and time.monotonic() < deadline and not stop_now():
            await asyncio.sleep(0.05)
        self.fail_all(APIError(503, "the server shut down before this request finished"))
        deadline = time.monotonic() + _FAILED_RESPONSES_SECONDS
        while self.live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)


class Generation:
    """Async iterator over (choice index, RequestOutput) until every choice has finished.

    close() (idempotent) aborts what still runs. fail(error) makes the iteration raise error
    (a timeout, shutdown, a dead engine); the consumer's own close() then aborts the choices."""

    def __init__(self, client: EngineClient, choices: list[Choice], request_id: str):
        self.client, self.choices = client, choices
        self.queue: asyncio.Queue = asyncio.Queue()
        self.aio = asyncio.get_running_loop()
        self.streams, self.closed = [], False
        self.start = time.monotonic()
        self.last_time = [None] * len(choices)
        self.counted = [False] * len(choices)
        self.num_finished = 0
        self.timer: asyncio.TimerHandle | None = None
        client.live.add(self)
        try:
            for i, c in enumerate(choices):
                deliver = _deliverer(self.aio, self._receive, i)
                self.streams.append(client.engine_loop.submit(c.prompt, None, f"{request_id}-{i}", deliver))
                client.num_pending += 1
        except BaseException:
            self.close()
            raise

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.num_finished == len(self.choices):
            raise StopAsyncIteration
        index, out = await self.queue.get()
        if isinstance(out, BaseException):
            raise out
        if getattr(out, "error", None):
            raise RuntimeError(out.error)
        self._observe(index, out)
        if out.finished:
            self.num_finished += 1
        return index, out

    async def final_outputs(self) -> list:
        """Runs the choices to the end (a non-streaming response): each one's finished output."""
        final = [None] * len(self.choices)
        async for index, out in self:
            if out.finished:
                final[index] = out
        return final

    def fail(self, error: BaseException) -> None:
        if not self.closed:
            self.queue.put_nowait((None, error))

    def fail_at(self, deadline: float, error: BaseException) -> None:
        self.timer = self.aio.call_later(max(deadline - time.monotonic(), 0.0), self.fail, error)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
        for stream in self.streams:
            stream.close()      # aborts the request unless it has finished
        self.client.num_pending -= len(self.streams)
        self.client.live.discard(self)
        # A finished output that arrived but was never read: no abort follows it, so it is counted now.
        while not self.queue.empty():
            index, out = self.queue.get_nowait()
            if getattr(out, "finished", False):
                self._count(index, out)

    def _receive(self, index: int, out) -> None:
        """On the event loop, for each delivery of the loop thread."""
        if not self.closed:
            self.queue.put_nowait((index, out))
        elif getattr(out, "finished", False):   # the abort of a choice that was still running
            self._count(index, out)

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
            self._count(index, out)

    def _count(self, index: int, out) -> None:
        if not self.counted[index]:
            self.counted[index] = True
            self.client.metrics.observe_finished(out, time.monotonic() - self.start,
                                                 self.choices[index].counts_prompt)


def _deliverer(aio: asyncio.AbstractEventLoop, receive, index: int):
    """on_output for the loop thread: must not block, and must not fail once the HTTP side
    has gone (its event loop closed at shutdown)."""
    def deliver(output) -> None:
        try:
            aio.call_soon_threadsafe(receive, index, output)
        except RuntimeError:
            pass
    return deliver
