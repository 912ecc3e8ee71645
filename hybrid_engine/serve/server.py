"""Running the app under uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks, notebooks), always on a socket bound here so port 0 picks a free port."""

from __future__ import annotations

import socket
import threading

import uvicorn


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


def make_server(app, log_level: str = "warning") -> uvicorn.Server:
    # One worker process: the engine lives in this process. timeout_graceful_shutdown: open
    # streams are cut at shutdown instead of waiting for them to finish.
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_graceful_shutdown=2,
                            lifespan="off")
    return uvicorn.Server(config)


class BackgroundServer:
    """uvicorn on a daemon thread: `with BackgroundServer(app) as s: openai.OpenAI(base_url=s.url + "/v1")`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        self.sock = bind(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = make_server(app, log_level)
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
