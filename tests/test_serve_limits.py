"""What keeps one client from stalling the others: a prompt far longer than the context is
refused before it is tokenized, and tokenizing runs off the event loop, so /health answers
at once meanwhile; a full server answers 503 with Retry-After. Every wait is bounded."""

import contextlib
import re
import threading
import time

import httpx
import pytest

from hybrid_engine import LLM
from hybrid_engine.serve.app import create_app
from hybrid_engine.serve.server import BackgroundServer
from serve_support import running_server, wait_until_empty


@pytest.fixture(scope="module")
def llm():
    llm = LLM(max_num_seqs=4)
    yield llm
    llm.shutdown()


def health_latencies_while(server, work) -> tuple[object, list[float]]:
    """work() on a thread while /health is asked again and again: its result and each answer's seconds."""
    result, latencies = {}, []
    thread = threading.Thread(target=lambda: result.setdefault("r", work()))
    thread.start()
    with httpx.Client(timeout=30) as http:
        while thread.is_alive():
            start = time.monotonic()
            assert http.get(server.url + "/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.05)
    thread.join()
    return result["r"], latencies


def test_a_10mb_prompt_is_refused_at_once_and_health_answers_meanwhile(llm):
    prompt = "def main():\n    return 1\n" * 400_000   # 10.4 MB
    with running_server(llm) as server:
        for path, body, field in (
                ("/v1/completions", {"model": "default", "prompt": prompt, "max_tokens": 2}, "prompt"),
                ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": prompt}],
                                          "max_tokens": 2}, "messages")):
            def refuse():
                start = time.monotonic()
                return httpx.post(server.url + path, json=body, timeout=120), time.monotonic() - start

            (r, seconds), latencies = health_latencies_while(server, refuse)
            assert r.status_code == 400, r.text[:200]
            error = r.json()["error"]
            assert error["param"] == field
            counted = re.match(rf"{field}: (\d+) characters", error["message"])   # chat: with the template's
            assert counted and len(prompt) <= int(counted.group(1)) < len(prompt) + 200
            assert f"maximum context length of {llm.engine.max_model_len} tokens" in error["message"]
            assert seconds < 5 and max(latencies, default=0) < 1.0, (seconds, latencies)


def test_tokenizing_runs_off_the_event_loop(llm, monkeypatch):
    """A tokenization that takes 2 s (a long prompt within the context, a slow tokenizer) holds
    a worker thread, not the event loop: /health answers within a second all along."""
    tokenizer = llm.engine.tokenizer
    encode = tokenizer.encode

    def slow_encode(text, **kw):
        time.sleep(2.0)
        return encode(text, **kw)
    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    with running_server(llm) as server:
        body = {"model": "default", "prompt": "import os\n", "max_tokens": 2}
        r, latencies = health_latencies_while(server, lambda: httpx.post(server.url + "/v1/completions",
                                                                         json=body, timeout=60))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert len(latencies) >= 5 and max(latencies) < 1.0, latencies


def test_a_full_server_answers_503_with_retry_after_until_a_place_frees(llm):
    app = create_app(llm.loop, model_name="default", max_waiting_requests=1)   # 4 running + 1 waiting
    long = {"model": "default", "prompt": "x = 1", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with BackgroundServer(app) as s, httpx.Client(timeout=60) as http, contextlib.ExitStack() as streams:
        for _ in range(5):
            assert streams.enter_context(http.stream("POST", s.url + "/v1/completions", json=long)).status_code == 200
        r = http.post(s.url + "/v1/completions", json={**long, "stream": False})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert "overloaded" in r.json()["error"]["message"]
        streams.pop_all().close()   # the clients leave: their places are freed as the server sees them go
        deadline = time.monotonic() + 10
        while app.state.serve.client.num_pending and time.monotonic() < deadline:
            time.sleep(0.02)
        r = http.post(s.url + "/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        usage = wait_until_empty(llm.loop, timeout=10)
        assert (usage["blocks_used"], usage["num_engine_requests"]) == (0, 0)
