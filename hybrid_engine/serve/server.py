"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks, notebooks), always on a socket bound here so port 0 picks a free port.

Shutdown drains before uvicorn's own: on SIGTERM or Ctrl-C (or should_exit) the server keeps
listening, but answers 503 to new requests (and /health), lets the requests in flight finish
for up to shutdown_timeout seconds, and aborts the rest with an error their clients see (an
error event and [DONE] on a stream); only then does uvicorn close the connections, so no
response is cut and no task is cancelled. A second signal ends the wait at once.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading

import uvicorn

from .limits import DEFAULT_SHUTDOWN_TIMEOUT

# uvicorn's own wait for the connections to close, after the drain: every response has ended
# by then, so this only bounds a client slow to take the last bytes.
_UVICORN_GRACE_SECONDS = 2
_log = logging.getLogger("uvicorn.error")


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    # Listening now, not when uvicorn starts: a client that connects in between waits in the
    # backlog instead of being refused.
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class DrainingServer(uvicorn.Server):
    """uvicorn with the drain described above. `signals` lists the signals it received."""

    def __init__(self, app, log_level: str, shutdown_timeout: float):
        # One worker process: the engine lives in this process.
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=_UVICORN_GRACE_SECONDS)
        super().__init__(config)
        self.serve_state = app.state.serve
        self.shutdown_timeout = shutdown_timeout
        self.signals: list[int] = []

    def handle_exit(self, sig: int, frame) -> None:
        self.signals.append(sig)
        if self.should_exit:   # a second signal: stop waiting for the requests in flight
            self.force_exit = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, less its raising the signal again at the end (SIGTERM would kill the
        process before the engine is shut down): the caller reads `signals` instead."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def main_loop(self) -> None:
        await super().main_loop()   # returns once should_exit
        in_flight = len(self.serve_state.client.live) if self.serve_state.client is not None else 0
        if in_flight:
            _log.info("Draining: waiting up to %g s for %d requests in flight (signal again to stop now)",
                      self.shutdown_timeout, in_flight)
        await self.serve_state.drain(self.shutdown_timeout, lambda: self.force_exit)


def make_server(app, log_level: str = "warning",
                shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> DrainingServer:
    return DrainingServer(app, log_level, shutdown_timeout)


class BackgroundServer:
    """uvicorn on a daemon thread: `with BackgroundServer(app) as s: openai.OpenAI(base_url=s.url + "/v1")`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float = 0.0):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = make_server(app, log_level, shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="hybrid-engine-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        for _ in range(int(timeout / 0.02)):
            if self.server.started:
                return self
            if not self.thread.is_alive():
                break
            self.thread.join(0.02)
        raise RuntimeError(f"the HTTP server did not start on {self.url}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
