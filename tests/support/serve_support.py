"""Helpers of the serve tests: an HTTP server on 127.0.0.1 (a free port) in a thread, and
reading the engine's cache usage through its loop thread, and the offline reference params."""

from __future__ import annotations

import time
from dataclasses import replace
from contextlib import contextmanager

import openai

from hybrid_engine.serve.app import create_app
from hybrid_engine.serve.server import BackgroundServer


@contextmanager
def running_server(llm, model_name: str = "default", api_key: str | None = None):
    """The app on llm's engine loop, with llm's default sampling params, as `hybrid-engine serve` makes it."""
    app = create_app(llm.loop, model_name=model_name, api_key=api_key, default_params=llm.get_default_sampling_params())
    with BackgroundServer(app, host="127.0.0.1", port=0) as server:
        server.app = app
        yield server


def offline_params(llm, **fields):
    """What a request with these fields means: the defaults (generation_config.json) updated."""
    return replace(llm.get_default_sampling_params(), **fields)


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


def record_aborts(engine, monkeypatch) -> list:
    """The outputs of every abort the engine carries out: what each request held by then."""
    aborted, abort_request = [], engine.abort_request

    def recording_abort(request_id):
        out = abort_request(request_id)
        if out is not None:
            aborted.append(out)
        return out
    monkeypatch.setattr(engine, "abort_request", recording_abort)
    return aborted
