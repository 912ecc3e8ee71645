"""Every way a generation request can end early aborts its engine requests at once and is
counted in /metrics (finished_reason "abort", with its tokens): a stream whose first send fails
before its body has started, a client leaving mid-stream, a non-streaming client giving up, a
request past its X-Request-Timeout, an engine that died. Every wait is bounded."""

import asyncio
import json
import time

import httpx
import pytest

from hybrid_engine import LLM
from hybrid_engine.engine_loop import EngineLoop
from hybrid_engine.serve.app import create_app
from serve_support import record_aborts, running_server, wait_until_empty

PROMPT = "def read_config(path):"
LONG = {"model": "default", "prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
ABORTS = 'vllm:request_success_total{finished_reason="abort",model_name="default"}'
GENERATED = 'vllm:generation_tokens_total{model_name="default"}'
PROMPT_TOKENS = 'vllm:prompt_tokens_total{model_name="default"}'


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_num_seqs=8)
    yield llm
    llm.shutdown()


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def scrape(server, name: str) -> float:
    return metric(httpx.get(server.url + "/metrics", timeout=10).text, name)


def wait_for_metric(server, name: str, value: float, timeout: float = 10.0) -> float:
    """The abort outputs reach the server a loop turn after the abort: poll for them."""
    deadline = time.monotonic() + timeout
    while (got := scrape(server, name)) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return got


def assert_nothing_held(llm, app) -> None:
    usage = wait_until_empty(llm.loop, timeout=10)
    assert (usage["blocks_used"], usage["slots_used"], usage["num_engine_requests"]) == (0, 0, 0)
    assert app.state.serve.client.num_pending == 0 and not app.state.serve.client.live


# ---- the first send fails before the body iterator has started ---------------------------------

def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}


async def _call_with_failing_send(app, path: str, body: dict) -> None:
    """As an ASGI server may do after a disconnect: send raises OSError at the first message."""
    delivered = False

    async def receive():
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await asyncio.sleep(3600)   # the client never says it left

    async def send(message):
        raise OSError("the connection is gone")

    await app(_scope(path), receive, send)


def test_a_stream_whose_first_send_fails_is_aborted_and_counted(llm, monkeypatch):
    aborted = record_aborts(llm.engine, monkeypatch)
    app = create_app(llm.loop, model_name="default")
    metrics = app.state.serve.metrics

    async def run_all():
        jobs = [_call_with_failing_send(app, "/v1/completions", {**LONG, "stream": True}) for _ in range(10)]
        jobs += [_call_with_failing_send(app, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3000, "ignore_eos": True,
            "stream": True}) for _ in range(10)]
        await asyncio.wait_for(asyncio.gather(*jobs), timeout=60)
        assert app.state.serve.client.num_pending == 0   # closed at once, not at some later turn
        deadline = time.monotonic() + 10   # the aborts' outputs come back through this event loop
        while metric(metrics.render(None).decode(), ABORTS) < 20 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    asyncio.run(run_all())
    assert len(aborted) == 20 and all(o.finish_reason == "abort" for o in aborted)
    assert metric(metrics.render(None).decode(), ABORTS) == 20
    assert_nothing_held(llm, app)


# ---- clients that leave: counted with their tokens ---------------------------------------------

def test_clients_leaving_mid_stream_are_counted_with_their_tokens(llm, monkeypatch):
    aborted = record_aborts(llm.engine, monkeypatch)
    with running_server(llm) as server:
        async def leave_after_three_chunks(http: httpx.AsyncClient) -> int:
            chunks = 0
            async with http.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}) as r:
                async for line in r.aiter_lines():
                    chunks += line.startswith("data: ")
                    if chunks == 3:
                        break
            return chunks

        async def run_all():
            async with httpx.AsyncClient(timeout=60) as http:
                return await asyncio.wait_for(asyncio.gather(*[leave_after_three_chunks(http) for _ in range(4)]), 60)

        assert asyncio.run(run_all()) == [3] * 4
        assert wait_for_metric(server, ABORTS, 4) == 4
        assert len(aborted) == 4 and all(3 <= len(o.token_ids) < 3000 for o in aborted)
        assert scrape(server, GENERATED) == sum(len(o.token_ids) for o in aborted)
        assert scrape(server, PROMPT_TOKENS) == sum(len(o.prompt_token_ids) for o in aborted)
        assert_nothing_held(llm, server.app)


def test_a_non_streaming_client_that_gives_up_is_counted(llm, monkeypatch):
    aborted = record_aborts(llm.engine, monkeypatch)
    with running_server(llm) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json={**LONG, "n": 2}, timeout=1.0)
        assert wait_for_metric(server, ABORTS, 2) == 2
        assert len(aborted) == 2
        assert scrape(server, GENERATED) == sum(len(o.token_ids) for o in aborted)
        assert_nothing_held(llm, server.app)


# ---- X-Request-Timeout ---------------------------------------------------------------------------

def test_a_request_past_its_timeout_is_aborted_with_a_408(llm):
    with running_server(llm) as server:
        headers = {"X-Request-Timeout": "0.5"}
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=LONG, headers=headers, timeout=30)
        assert r.status_code == 408 and "X-Request-Timeout" in r.json()["error"]["message"]
        assert time.monotonic() - start < 5
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True},
                          headers=headers, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["error"]["code"] == 408
        assert wait_for_metric(server, ABORTS, 2) == 2
        assert_nothing_held(llm, server.app)
        for bad in ("soon", "0", "-1", "nan", "inf"):
            r = httpx.post(server.url + "/v1/completions", json=LONG, headers={"X-Request-Timeout": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "X-Request-Timeout", bad
        quick = httpx.post(server.url + "/v1/completions", headers={"X-Request-Timeout": "60"},
                           json={"model": "default", "prompt": PROMPT, "max_tokens": 3}, timeout=30)
        assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 3


# ---- the engine dies -------------------------------------------------------------------------

def test_requests_of_an_engine_that_died_end_with_an_error(llm, monkeypatch):
    with running_server(llm) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")   # running
            monkeypatch.setattr(EngineLoop, "is_dead", property(lambda self: True))
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == 500
        assert httpx.get(server.url + "/health").status_code == 503
        r = httpx.post(server.url + "/v1/completions", json=LONG, timeout=30)
        assert r.status_code == 503 and "engine has stopped" in r.json()["error"]["message"]
        monkeypatch.undo()
        assert_nothing_held(llm, server.app)
        assert httpx.get(server.url + "/health").status_code == 200


# ---- faults inside the engine: answers or 5xx, never a hang --------------------------------------

def _fail_once(monkeypatch, obj, name: str) -> list:
    """obj.name raises RuntimeError on its first call, then works; returns the calls' count."""
    calls, original = [], getattr(obj, name)

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(f"injected fault in {name}")
        return original(*args, **kwargs)
    monkeypatch.setattr(obj, name, failing)
    return calls


def test_a_step_fault_fails_the_requests_in_it_with_5xx_and_the_server_serves_on(llm, monkeypatch):
    with running_server(llm) as server:
        with httpx.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")   # running
            _fail_once(monkeypatch, llm.engine.runner, "forward")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["error"]["code"] == 500
        _fail_once(monkeypatch, llm.engine.runner, "forward")
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
        monkeypatch.undo()
        after = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200
        assert_nothing_held(llm, server.app)


def test_an_abort_that_raises_after_a_disconnect_leaves_completions_and_metrics_answering(llm, monkeypatch):
    """The issue's repro: a mid-stream disconnect whose abort raises killed the loop thread, and
    then /health said 200 while completions and /metrics hung."""
    with running_server(llm) as server:
        calls = _fail_once(monkeypatch, llm.engine, "abort_request")
        # Its abort fails, so the request runs on to its max_tokens with nobody reading it.
        short = {**LONG, "max_tokens": 64, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=short, timeout=30) as r:
            assert next(r.iter_lines()).startswith("data: ")
        deadline = time.monotonic() + 10
        while not calls and time.monotonic() < deadline:   # the disconnect reaches the loop
            time.sleep(0.05)
        assert calls, "the disconnect did not abort the request"
        r = httpx.post(server.url + "/v1/completions", json={**LONG, "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.url + "/metrics", timeout=5).status_code == 200
        assert httpx.get(server.url + "/health", timeout=5).status_code == 200
        monkeypatch.undo()
        assert_nothing_held(llm, server.app)
