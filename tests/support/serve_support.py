"""Helpers of the serve tests: an HTTP server on 127.0.0.1 (a free port) in a thread, and
reading the engine's cache usage through its loop thread."""

from __future__ import annotations

import time
from contextlib import contextmanager

import openai

from hybrid_engine.serve.app import create_app
from hybrid_engine.serve.server import BackgroundServer


@contextmanager
def running_server(engine_loop, model_name: str = "default", api_key: str | None = None):
    app = create_app(engine_loop, model_name=model_name, api_key=api_key)
    with BackgroundServer(app, host="127.0.0.1", port=0) as server:
        server.app = app
        yield server


def client(server, api_key: str = "none", asynchronous: bool = False):
    cls = openai.AsyncOpenAI if asynchronous else openai.OpenAI
    return cls(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120)


def cache_usage(engine_loop) -> dict:
    def read(engine):
        usage = engine.cache.usage()
        usage["num_engine_requests"] = len(engine.requests)
        usage["unfinished"] = engine.has_unfinished_requests()
        return usage
    return engine_loop.run_on_loop(read)


def wait_until_empty(engine_loop, timeout: float = 20.0) -> dict:
    """The cache usage once nothing is held (or at the timeout, for the test to report)."""
    deadline = time.monotonic() + timeout
    while True:
        usage = cache_usage(engine_loop)
        if (usage["blocks_used"] == 0 and usage["slots_used"] == 0 and usage["num_engine_requests"] == 0
                and not usage["unfinished"]) or time.monotonic() > deadline:
            return usage
        time.sleep(0.05)
