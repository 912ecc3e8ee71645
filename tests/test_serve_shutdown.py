"""`hybrid-engine serve` shutting down, as a subprocess on 127.0.0.1: SIGTERM with 16 streams in
flight drains them (503 for anything new, the ones that can finish finish, the rest end with an
error event and [DONE] at --shutdown-timeout) and exits 0 in time; Ctrl-C twice stops at once,
without a traceback; a port in use is one error line. Every wait is bounded."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from hybrid_engine.cli import main
from subprocess_signals import default_sigint

LONG_TOKENS = 2000


def start_server(*flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=default_sigint)
    url = re.search(r"http://127\.0\.0\.1:\d+", proc.stderr.readline()).group(0)
    assert wait_for_health(url, 200, timeout=120), "the server did not become ready"
    return proc, url


def wait_for_health(url: str, status: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if httpx.get(url + "/health", timeout=10).status_code == status:
            return True
        time.sleep(0.05)
    return False


class StreamingClient:
    """One streamed completion on a thread: its `data:` payloads, and an event at the first."""

    def __init__(self, url: str, max_tokens: int):
        self.events: list[str] = []
        self.started = threading.Event()
        body = {"model": "default", "prompt": "def main():", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:])
                    self.started.set()

    def ending(self) -> dict:
        """The last chunk before [DONE] (which must end the stream)."""
        self.thread.join(30)
        assert self.events[-1] == "[DONE]", self.events[-3:]
        return json.loads(self.events[-2])


def test_sigterm_with_16_requests_in_flight_drains_them_and_exits_0():
    timeout = 5
    proc, url = start_server("--max-num-seqs", "16", "--shutdown-timeout", str(timeout), "--log-level", "warning")
    try:
        # even ones finish within the drain, odd ones cannot
        clients = [StreamingClient(url, 30 if i % 2 == 0 else LONG_TOKENS) for i in range(16)]
        assert all(c.started.wait(60) for c in clients)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert wait_for_health(url, 503, timeout=3)
        r = httpx.post(url + "/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert proc.wait(timeout=timeout + 5) == 0
        assert time.monotonic() - signalled < timeout + 5
        for i, client in enumerate(clients):
            ending = client.ending()
            if i % 2 == 0:
                assert ending["choices"][0]["finish_reason"] == "length"
            else:
                assert ending["error"]["code"] == 503 and "shut down" in ending["error"]["message"]
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_second_ctrl_c_stops_at_once_and_quietly():
    proc, url = start_server("--max-num-seqs", "2", "--shutdown-timeout", "60")   # the default log level
    try:
        client = StreamingClient(url, LONG_TOKENS)
        assert client.started.wait(60)
        proc.send_signal(signal.SIGINT)
        assert wait_for_health(url, 503, timeout=3)   # draining, and would wait 60 s
        proc.send_signal(signal.SIGINT)
        again = time.monotonic()
        assert proc.wait(timeout=10) == 130
        assert time.monotonic() - again < 5
        assert client.ending()["error"]["code"] == 503
        err = proc.stderr.read()
        assert "Traceback" not in err and "ERROR" not in err, err
        assert err.rstrip().endswith("hybrid-engine: interrupted")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_in_use_is_one_error_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err == f"hybrid-engine: error: cannot listen on 127.0.0.1:{port}: Address already in use\n"
