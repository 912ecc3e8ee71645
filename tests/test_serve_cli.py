"""`hybrid-engine serve` as users start it: a subprocess on 127.0.0.1 and a free port, /health
503 then 200, a completion, Ctrl-C (exit code 130); and a bad flag is one error line with exit code 2."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx

from hybrid_engine.cli import main

from subprocess_signals import default_sigint

ERROR_PREFIX = "hybrid-engine: error: "


def test_serve_starts_answers_and_stops_on_ctrl_c():
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "serve", "--port", "0", "--max-num-seqs", "2",
           "--api-key", "k", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                            preexec_fn=default_sigint)
    try:
        line = proc.stderr.readline()
        url = re.search(r"http://127\.0\.0\.1:\d+", line).group(0)
        deadline = time.monotonic() + 120
        status = None
        while time.monotonic() < deadline:
            status = httpx.get(url + "/health").status_code
            assert status in (200, 503)
            if status == 200:
                break
            time.sleep(0.1)
        assert status == 200
        r = httpx.post(url + "/v1/completions", headers={"Authorization": "Bearer k"}, timeout=60,
                       json={"model": "default", "prompt": "import os\n", "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(url + "/v1/models").status_code == 401
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130   # the CLI's exit code for Ctrl-C, after a clean shutdown
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_port_is_one_error_line(capsys):
    assert main(["serve", "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(ERROR_PREFIX + "--port must be in 0..65535") and err.count("\n") == 1
