"""One engine loop serving many callers: a background thread owns the LLMEngine.

The engine is not thread-safe (the scheduler, the cache and the persistent step buffers are
plain objects changed by every step), so exactly one thread touches it: the loop thread runs
every state-changing engine call (add, abort, step) and `run_on_loop` functions, in the order
they were submitted. Callers on any thread validate their request in their own thread (a bad
one raises ValueError there and nothing is queued) and receive only their own outputs, either
buffered in a RequestStream or passed to an `on_output` callback on the loop thread (vLLM's
AsyncLLM hands outputs to per-request queues the same way).

The loop thread also builds the engine (`EngineLoop(make_engine)`), so that it is the process's
only thread that runs torch's parallel CPU ops. Each thread that does gets an OpenMP team of
its own, and while two teams are alive there are more OpenMP threads than cores (libgomp then
most likely stops spinning between parallel regions, so each one waits on a wake-up; not
verified: GOMP_SPINCOUNT did not change it). Measured on a
2-core AMD EPYC, default model, batch-1 decode: 540-660 tok/s, and 220-250 while a second
thread that had run one matrix product was alive. Loading on the caller's thread and stepping
on the loop thread was such a pair, so `LLM.generate` decoded at half speed.

A step that raises does not end the loop: the requests that were running in it (the ones
whose cache state the failed step may have left half-written) are aborted and their
consumers get the exception — a RequestStream raises it from iteration, an `on_output`
callback is called once with the exception instance instead of a RequestOutput — and the
loop keeps serving every other request.
"""

from __future__ import annotations

import copy
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from .engine import LLMEngine
from .outputs import RequestOutput
from .request_group import check_caller_request_id, new_request_id
from .sampling_params import SamplingParams

T = TypeVar("T")
# What a consumer receives: each output delta of its request, or the exception that ended it.
Delivery = RequestOutput | BaseException
Consumer = Callable[[Delivery], None]


class EngineDeadError(RuntimeError):
    """The engine loop cannot go on (vLLM's name): every pending and later call raises it at once."""


class EngineLoop:
    """One background thread owns the LLMEngine and is the only caller of engine.step() and
    of every engine method that changes state; callers on any thread (or an asyncio loop)
    submit requests and receive only their own outputs."""

    def __init__(self, make_engine: Callable[[], LLMEngine]):
        """Starts the loop thread, which calls make_engine() (an error there is raised here)."""
        # Re-entrant: a RequestStream garbage-collected on the loop thread aborts through here.
        self._wake = threading.Condition(threading.RLock())
        self._commands: deque[Callable[[], None]] = deque()
        # Requests submitted and not yet finished, with their consumers. Guarded by _wake, so
        # that a request id is reserved the moment submit() returns.
        self._consumers: dict[str, Consumer] = {}
        self._closed = False
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, built), name="hybrid-engine-loop",
                                        daemon=True)   # an interpreter exiting with requests in flight is not held up
        self._thread.start()
        self._engine: LLMEngine = built.result()

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    @property
    def is_dead(self) -> bool:
        """True once the loop thread has ended for any reason but shutdown()."""
        return not self._thread.is_alive() and not self._closed

    # ---- callers' side (any thread) ------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               on_output: Consumer | None = None) -> RequestStream:
        """Validates in the caller's thread (ValueError naming the problem, nothing queued) and
        hands the request to the loop. With on_output, each RequestOutput delta of this request
        is passed to it on the loop thread (it must not block: e.g. an asyncio server passes
        `lambda o: aio_loop.call_soon_threadsafe(queue.put_nowait, o)`); if a step fails, it
        is called once with the exception instead. Without it the outputs are buffered in the
        returned stream.

        With on_output the returned stream is only a handle: close() aborts the request, but
        dropping the handle does not (the callback is the consumer)."""
        # A private copy: the caller may change or reuse its SamplingParams while this runs.
        params = copy.deepcopy(self._engine.validate_params(params))
        text, token_ids = self._engine.encode_prompt(prompt)
        if request_id is not None:
            if not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str or None, got {type(request_id).__name__}")
            check_caller_request_id(request_id)
        buffer: queue.SimpleQueue | None = None
        if on_output is None:
            buffer = queue.SimpleQueue()
            on_output = buffer.put
        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is shut down")
            request_id = self._reserve_id(request_id)
            self._consumers[request_id] = on_output
            self._commands.append(lambda: self._add(request_id, text, token_ids, params))
            self._wake.notify()
        return RequestStream(self, request_id, buffer)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's memory is freed at the loop's next turn."""
        with self._wake:
            if request_id in self._consumers and not self._closed:
                self._commands.append(lambda: self._abort(request_id))
                self._wake.notify()

    def run_on_loop(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the loop thread (between steps) and returns its result."""
        if threading.current_thread() is self._thread:
            return fn(self._engine)
        done: Future = Future()

        def call() -> None:
            try:
                done.set_result(fn(self._engine))
            except BaseException as e:  # handed to the caller, not to the loop
                done.set_exception(e)

        with self._wake:
            if self._closed:
                raise RuntimeError("the engine loop is shut down")
            self._commands.append(call)
            self._wake.notify()
        return done.result()

    def shutdown(self) -> None:
        """Aborts every unfinished request (its consumer gets the abort output) and joins the thread."""
        with self._wake:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _reserve_id(self, request_id: str | None) -> str:
        if request_id is None:
            return new_request_id(self._consumers.__contains__)
        if request_id in self._consumers:
            raise ValueError(f"request id {request_id!r} is already in use")
        return request_id

    # ---- the loop thread -----------------------------------------------------------------
    def _run(self, make_engine: Callable[[], LLMEngine], built: Future) -> None:
        try:
            self._engine = make_engine()
        except BaseException as e:  # handed to the constructor's caller; the thread ends
            built.set_exception(e)
            return
        built.set_result(self._engine)
        busy = False
        while True:
            with self._wake:
                while not self._commands and not busy and not self._closed:
                    self._wake.wait()   # idle: nothing unfinished, nothing submitted
                commands, self._commands = self._commands, deque()
                closed = self._closed
            for command in commands:
                command()
            if closed:
                self._abort_all()
                return
            busy = self._engine.has_unfinished_requests()
            if busy:
                self._step()

    def _add(self, request_id: str, text: str | None, token_ids: list[int], params: SamplingParams) -> None:
        if request_id not in self._consumers:   # aborted before it reached the loop
            return
        try:
            self._engine.add_request(token_ids, params, request_id, prompt_text=text)
        except Exception as e:   # validated in submit(), so only an engine fault lands here
            self._deliver_error(request_id, e)

    def _abort(self, request_id: str) -> None:
        out = self._engine.abort_request(request_id)
        if out is not None:
            self._deliver(out)
        else:
            with self._wake:
                self._consumers.pop(request_id, None)

    def _abort_all(self) -> None:
        with self._wake:
            ids = list(self._consumers)
        for request_id in ids:
            self._abort(request_id)

    def _step(self) -> None:
        # Callers' ids: the n samples of a request fail together, as they abort together.
        running = [req.caller_request_id for req in self._engine.scheduler.running]
        try:
            outputs = self._engine.step()
        except Exception as e:
            # The step may have been admitting waiting requests too: those are running now.
            # A step that failed before running any (no request fits) fails them all, or the
            # loop would raise again at once, forever.
            failed = set(running) | {req.caller_request_id for req in self._engine.scheduler.running}
            if not failed:
                failed = {req.caller_request_id for req in self._engine.requests.values()}
            for request_id in failed:
                self._engine.abort_request(request_id)
                self._deliver_error(request_id, e)
            return
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        with self._wake:
            consumer = (self._consumers.pop if out.finished else self._consumers.get)(out.request_id, None)
        if consumer is None:
            return
        try:
            consumer(out)
        except Exception:
            # A consumer that fails is treated as gone: its request stops, the loop goes on.
            if not out.finished:
                self._abort(out.request_id)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._wake:
            consumer = self._consumers.pop(request_id, None)
        if consumer is not None:
            try:
                consumer(error)
            except Exception:
                pass   # the request is over either way; a broken consumer cannot be told more


class RequestStream:
    """Iterable over this request's RequestOutput deltas; ends after the finished one.

    Closing it (close(), breaking out of the generator `iter()` returns, or dropping it) aborts
    the request if it has not finished, and its memory is freed at the loop's next turn."""

    def __init__(self, loop: EngineLoop, request_id: str, buffer: queue.SimpleQueue | None):
        self.request_id = request_id
        self._loop = loop
        self._buffer = buffer
        self._finished = False

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._buffer is None:
            raise TypeError("this request's outputs go to its on_output callback; the stream only aborts")
        try:
            while not self._finished:
                item = self._buffer.get()
                if isinstance(item, BaseException):
                    self._finished = True
                    raise item
                self._finished = item.finished
                yield item
        finally:
            self.close()

    def close(self) -> None:
        if not self._finished:
            self._finished = True
            self._loop.abort(self.request_id)

    def __del__(self) -> None:
        if self._buffer is not None:   # with on_output the callback, not this handle, consumes
            self.close()
