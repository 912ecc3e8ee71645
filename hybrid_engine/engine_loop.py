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

No caller is ever left waiting:
- A step that raises does not end the loop: the engine has aborted the requests that were
  running in it (LLMEngine.step, StepFailedError) and their consumers get the exception (a
  RequestStream raises it from iteration, an `on_output` callback is called once with the
  exception instance instead of a RequestOutput); every other request goes on. A failure the
  engine did not report so (a step that raised something else) ends every request it holds.
- An abort or an add that raises ends that request with the exception; a `run_on_loop`
  function's exception is raised in its caller; a consumer callback that raises is treated
  as gone (its request is aborted). The loop goes on after each.
- If the engine cannot go on (cleaning up after a failed step failed, EngineDeadError) or
  anything else escapes the loop's body, the loop is dead: `is_dead` turns true, every
  pending consumer gets an EngineDeadError naming the cause, and every later submit and
  run_on_loop raises it at once. Callers wait with a liveness check (`receive`): a loop
  thread that ended without answering them is an EngineDeadError too, never a hang.
- At interpreter exit (a script's end, or Ctrl-C) every live loop is shut down and its thread
  joined, within EXIT_JOIN_TIMEOUT_S: a daemon thread still inside a torch / OpenMP op while
  the interpreter finalises aborted the process ("terminate called without an active
  exception", exit code 134).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TypeVar

from .engine import EngineDeadError, LLMEngine, PreparedPrompt, StepFailedError
from .outputs import RequestOutput
from .request_group import check_caller_request_id
from .sampling_params import SamplingParams

__all__ = ["EngineDeadError", "EngineLoop", "RequestStream", "StepFailedError"]

T = TypeVar("T")
# What a consumer receives: each output delta of its request, or the exception that ended it.
Delivery = RequestOutput | BaseException
Consumer = Callable[[Delivery], None]

# How often a waiting caller checks that the loop thread is still alive.
LIVENESS_POLL_S = 0.2
# How long interpreter exit waits for each loop to finish its step and abort what runs.
EXIT_JOIN_TIMEOUT_S = 30.0


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
        self._death: BaseException | None = None    # what ended the loop, once it has died
        built: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(make_engine, built), name="hybrid-engine-loop",
                                        daemon=True)   # exit is not held up by a step that never ends
        self._thread.start()
        self._engine: LLMEngine = built.result()
        _live_loops.add(self)

    @property
    def engine(self) -> LLMEngine:
        return self._engine

    @property
    def is_dead(self) -> bool:
        """True once the loop has died (module docstring), or its thread has ended other than by
        shutdown()."""
        return self._death is not None or (not self._thread.is_alive() and not self._closed)

    # ---- callers' side (any thread) ------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               on_output: Consumer | None = None) -> RequestStream:
        """Validates in the caller's thread (ValueError naming the problem, nothing queued) and
        hands the request to the loop. With on_output, each RequestOutput delta of this request
        is passed to it on the loop thread (it must not block: e.g. an asyncio server passes
        `lambda o: aio_loop.call_soon_threadsafe(queue.put_nowait, o)`); if the request fails,
        it is called once with the exception instead. Without it the outputs are buffered in
        the returned stream. EngineDeadError at once if the loop has died.

        With on_output the returned stream is only a handle: close() aborts the request, but
        dropping the handle does not (the callback is the consumer)."""
        prepared = self._engine.prepare(prompt, params)      # as it is where LLM prepared it already
        if request_id is not None:
            if not isinstance(request_id, str):
                raise ValueError(f"request_id must be a str or None, got {type(request_id).__name__}")
            check_caller_request_id(request_id)
        buffer: queue.SimpleQueue | None = None
        if on_output is None:
            buffer = queue.SimpleQueue()
            on_output = buffer.put
        with self._wake:
            self._check_open()
            request_id = self._reserve_id(request_id)
            self._consumers[request_id] = on_output
            self._commands.append(lambda: self._add(request_id, prepared))
            self._wake.notify()
        return RequestStream(self, request_id, buffer)

    def abort(self, request_id: str) -> None:
        """Thread-safe; the request's memory is freed at the loop's next turn."""
        with self._wake:
            if request_id in self._consumers and not self._closed and self._death is None:
                self._commands.append(lambda: self._abort(request_id))
                self._wake.notify()

    def run_on_loop(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the loop thread (between steps) and returns its result (or raises
        its exception); EngineDeadError if the loop has died, or dies before running it."""
        if threading.current_thread() is self._thread:
            return fn(self._engine)
        inbox: queue.SimpleQueue = queue.SimpleQueue()

        def call() -> None:
            try:
                inbox.put((True, fn(self._engine)))
            except BaseException as e:  # handed to the caller, not to the loop
                inbox.put((False, e))

        with self._wake:
            self._check_open()
            self._commands.append(call)
            self._wake.notify()
        ok, value = self.receive(inbox)
        if not ok:
            raise value
        return value

    def receive(self, inbox: queue.SimpleQueue):
        """The next item the loop puts into `inbox` (a consumer's queue). Waits only while the
        loop thread lives: once it has ended with nothing more there, raises EngineDeadError
        (or RuntimeError after shutdown()) instead of waiting forever."""
        while True:
            try:
                return inbox.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                if self._thread.is_alive():
                    continue
            try:   # it may have put the last item just before it ended
                return inbox.get_nowait()
            except queue.Empty:
                raise self._ended_error() from self._death

    def shutdown(self, timeout: float | None = None) -> None:
        """Aborts every unfinished request (its consumer gets the abort output) and joins the
        thread (waiting at most `timeout` seconds, if given, for the step it is in)."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _check_open(self) -> None:
        """Called holding _wake: a dead or shut-down loop takes nothing more."""
        if self.is_dead or self._closed:
            raise self._ended_error() from self._death

    def _ended_error(self) -> RuntimeError:
        if self._death is not None:
            error = EngineDeadError(f"the engine loop has died: {self._death!r}")
            error.__cause__ = self._death
            return error
        if self._closed:
            return RuntimeError("the engine loop is shut down")
        return EngineDeadError("the engine loop's thread has ended")

    def _reserve_id(self, request_id: str | None) -> str:
        if request_id is None:
            return self._engine.request_ids.new(self._consumers.__contains__)
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
        try:
            self._serve()
        except BaseException as e:   # the engine cannot go on, or a fault of the loop itself
            self._die(e)
        finally:
            self._engine.shutdown()  # its worker processes, where it has any

    def _serve(self) -> None:
        busy = False
        while True:
            with self._wake:
                while not self._commands and not busy and not self._closed:
                    self._wake.wait()   # idle: nothing unfinished, nothing submitted
                commands, self._commands = self._commands, deque()
                closed = self._closed
            for command in commands:
                command()               # each one handles its own errors
            if closed:
                self._abort_all()
                return
            busy = self._engine.has_unfinished_requests()
            if busy:
                self._step()

    def _add(self, request_id: str, prepared: PreparedPrompt) -> None:
        if request_id not in self._consumers:   # aborted before it reached the loop
            return
        try:
            self._engine.add_request(prepared, request_id=request_id)
        except Exception as e:   # validated in submit(), so only an engine fault lands here
            self._deliver_error(request_id, e)

    def _abort(self, request_id: str) -> None:
        try:
            out = self._engine.abort_request(request_id)
        except Exception as e:   # the request is over for its consumer either way
            self._deliver_error(request_id, e)
            return
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
        try:
            outputs = self._engine.step()
        except StepFailedError as e:   # the engine aborted the step's requests already
            self._fail(e.request_ids, e)
            return
        except EngineDeadError:
            raise
        except Exception as e:
            # Not the engine's report: what the step left half-done is unknown, so every request
            # it holds ends (an abort that raises here escapes: the loop dies).
            failed = list(dict.fromkeys(req.caller_request_id for req in self._engine.requests.values()))
            for request_id in failed:
                self._engine.abort_request(request_id)
            self._fail(failed, e)
            return
        for out in outputs:
            self._deliver(out)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for request_id in request_ids:
            self._deliver_error(request_id, error)

    def _deliver(self, out: RequestOutput) -> None:
        with self._wake:
            consumer = (self._consumers.pop if out.finished else self._consumers.get)(out.request_id, None)
        if consumer is None:
            return
        try:
            consumer(out)
        except BaseException:   # the caller's code: whatever it raises must not end the loop
            # A consumer that fails is treated as gone: its request stops and it is told
            # nothing more; the loop goes on.
            with self._wake:
                self._consumers.pop(out.request_id, None)
            if not out.finished:
                self._abort(out.request_id)

    def _deliver_error(self, request_id: str, error: BaseException) -> None:
        with self._wake:
            consumer = self._consumers.pop(request_id, None)
        if consumer is not None:
            _tell(consumer, error)

    def _die(self, cause: BaseException) -> None:
        """The loop cannot go on: every pending consumer, and every later caller, is told so."""
        with self._wake:
            self._death = cause
            consumers, self._consumers = self._consumers, {}
            self._commands.clear()      # run_on_loop callers see the thread end (receive)
        for consumer in consumers.values():
            _tell(consumer, self._ended_error())


def _tell(consumer: Consumer, error: BaseException) -> None:
    try:
        consumer(error)
    except BaseException:
        pass   # the request is over either way; a broken consumer cannot be told more


class RequestStream:
    """Iterable over this request's RequestOutput deltas; ends after the finished one, or raises
    the error that ended the request (EngineDeadError once the loop has died).

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
                item = self._loop.receive(self._buffer)
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


# Every loop whose thread may be running; weak, so that a dropped loop is not kept.
_live_loops: weakref.WeakSet[EngineLoop] = weakref.WeakSet()


@atexit.register
def _shut_down_live_loops() -> None:
    """At interpreter exit (after the script's non-daemon threads have ended, before the
    interpreter finalises): each loop finishes its step, aborts what runs and ends. Registered
    after torch's own exit handlers (this module imports torch first), so it runs before them."""
    for loop in list(_live_loops):
        loop.shutdown(EXIT_JOIN_TIMEOUT_S)
