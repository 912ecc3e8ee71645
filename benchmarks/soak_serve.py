"""Soak test of the HTTP server: mixed random traffic for a long while, then a look at what is left.

    python benchmarks/soak_serve.py [--duration 1800] [--clients 8] [--speculative-tokens 0]
                                    [--model default|FOLDER] [--seed 0] [--json out.json]

`hybrid-engine serve --port 0` runs as a subprocess on 127.0.0.1 (the embedded default model
unless --model says otherwise). --clients asyncio clients each send one request after another,
each of a kind drawn at random:

  stream         a streamed completion or chat, read to [DONE]
  complete       a non-streamed completion or chat
  disconnect     a stream dropped at a random point: before the first byte, after k chunks
  abandon        a non-streamed request whose client gives up before the answer
  bad            a malformed request (bad JSON, bad field, unknown model): must be a 4xx
  n              n = 2..4 choices, streamed or not
  stop           stop strings (a few, up to the cap)
  prefix         one of a few long shared prefixes plus a short tail: prefix-cache hits

Reported: requests by kind and outcome (ok, expected 4xx, unexpected status, exception),
latency p50/p99 per kind, the server's RSS every --rss-every seconds, and at the end, after the
traffic stops, the server's running/waiting gauges (must be 0) and the aborts it counted.
It is a benchmark, not a test: it prints numbers and never asserts timing; the JSON goes to
benchmarks/results/ and the figures to RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict, deque
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serve import percentiles  # noqa: E402

KINDS = ("stream", "complete", "disconnect", "abandon", "bad", "n", "stop", "prefix")
STDERR_TAIL: deque[str] = deque(maxlen=40)
WORDS = ("def", "class", "return", "import", "self", "value", "config", "path", "read", "write", "for", "in",
         "if", "else", "while", "print", "list", "dict", "open", "json")


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "serve", "--port", "0", "--log-level", "warning",
           "--served-model-name", "soak", "--max-num-seqs", str(args.max_num_seqs)]
    if args.model != "default":
        cmd += ["--model", args.model]
    if args.speculative_tokens:
        cmd += ["--speculative-tokens", str(args.speculative_tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    url = re.search(r"http://[\d.]+:\d+", proc.stderr.readline()).group(0)
    # The rest of stderr is drained on a thread (a full pipe would block the server); its
    # last lines are kept for the report.
    threading.Thread(target=lambda: STDERR_TAIL.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the server did not become ready: {''.join(STDERR_TAIL)}")
        time.sleep(0.2)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def metric_values(text: str, name: str) -> dict[str, float]:
    """{labels: value} of every sample of one metric in Prometheus text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            out[key[len(name):]] = float(value)
    return out


class Traffic:
    def __init__(self, url: str, rng: random.Random):
        self.url, self.rng = url, rng
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(4)]
        self.outcomes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        self.latency: dict[str, list[float]] = defaultdict(list)

    def text(self, words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(words))

    def body(self, kind: str) -> tuple[str, dict]:
        rng = self.rng
        chat = rng.random() < 0.5
        prompt = self.prompt_for(kind)
        body = {"model": "soak", "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.8])}
        if chat:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
        else:
            path, body["prompt"] = "/v1/completions", prompt
        if kind in ("stream", "disconnect", "prefix") or (kind in ("n", "stop") and rng.random() < 0.5):
            body["stream"] = True
        if kind == "n":
            body["n"] = rng.randint(2, 4)
        if kind == "stop":
            body["stop"] = [self.text(1) for _ in range(rng.randint(1, 16))]
        return path, body

    def prompt_for(self, kind: str) -> str:
        if kind == "prefix":
            return self.rng.choice(self.prefixes) + " " + self.text(self.rng.randint(1, 8))
        return self.text(self.rng.randint(1, 64))

    def bad(self) -> tuple[str, bytes]:
        return self.rng.choice([
            ("/v1/completions", b"{not json"),
            ("/v1/completions", json.dumps({"model": "soak", "prompt": "x", "max_tokens": -1}).encode()),
            ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode()),
            ("/v1/chat/completions", json.dumps({"model": "soak", "messages": []}).encode()),
            ("/v1/chat/completions", json.dumps({"model": "soak", "messages": [{"role": "user"}]}).encode()),
            ("/v1/completions", json.dumps({"model": "soak", "prompt": "x", "temperature": "hot"}).encode()),
            ("/v1/completions", json.dumps({"model": "soak", "prompt": "", "max_tokens": 4}).encode()),
        ])

    async def one(self, http: httpx.AsyncClient, kind: str) -> str:
        """-> the outcome: ok | 4xx | 5xx:<code> | status:<code> | <exception name>."""
        if kind == "bad":
            path, raw = self.bad()
            r = await http.post(self.url + path, content=raw, headers={"content-type": "application/json"})
            return "4xx" if 400 <= r.status_code < 500 else f"status:{r.status_code}"
        path, body = self.body(kind)
        if kind == "abandon":
            try:
                await asyncio.wait_for(http.post(self.url + path, json=body), self.rng.uniform(0.0, 0.3))
            except asyncio.TimeoutError:
                return "ok"   # gave up, as intended
            return "ok"
        if not body.get("stream"):
            r = await http.post(self.url + path, json=body)
            if r.status_code != 200:
                return f"status:{r.status_code}"
            choices = r.json()["choices"]
            return "ok" if len(choices) == body.get("n", 1) else "malformed"
        cut = self.rng.randint(0, 6) if kind == "disconnect" else None
        async with http.stream("POST", self.url + path, json=body) as r:
            if r.status_code != 200:
                return f"status:{r.status_code}"
            if cut == 0:
                return "ok"   # closed before reading a byte
            chunks, done = 0, False
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                if line.startswith("data: "):
                    if "error" in json.loads(line[6:]):
                        return "error-event"
                    chunks += 1
                    if cut is not None and chunks >= cut:
                        return "ok"   # dropped mid-stream
            return "ok" if done else "cut-without-done"

    async def client(self, http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            kind = self.rng.choice(KINDS)
            start = time.perf_counter()
            try:
                outcome = await self.one(http, kind)
            except (httpx.HTTPError, OSError) as e:
                outcome = type(e).__name__
            self.outcomes[kind][outcome] += 1
            if outcome in ("ok", "4xx"):
                self.latency[kind].append(time.perf_counter() - start)


async def soak(args, url: str, pid: int) -> dict:
    traffic = Traffic(url, random.Random(args.seed))
    rss = [(0.0, rss_mib(pid))]
    start = time.monotonic()
    until = start + args.duration

    async def sample_rss() -> None:
        while time.monotonic() < until:
            await asyncio.sleep(args.rss_every)
            rss.append((round(time.monotonic() - start, 1), rss_mib(pid)))

    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0),
                                 limits=httpx.Limits(max_connections=4 * args.clients)) as http:
        await asyncio.gather(sample_rss(), *(traffic.client(http, until) for _ in range(args.clients)))
        await asyncio.sleep(2.0)   # aborts of the last disconnects reach the loop
        metrics = (await http.get(url + "/metrics")).text
    rss.append((round(time.monotonic() - start, 1), rss_mib(pid)))
    return {
        "outcomes": {k: dict(v) for k, v in traffic.outcomes.items()},
        "latency_s": {k: {**percentiles(v), "count": len(v)}
                      for k, v in traffic.latency.items()},
        "rss_mib": rss,
        "after": {"running": metric_values(metrics, "vllm:num_requests_running"),
                  "waiting": metric_values(metrics, "vllm:num_requests_waiting"),
                  "finished": metric_values(metrics, "vllm:request_success_total")},
    }


def report(result: dict) -> None:
    total = sum(sum(v.values()) for v in result["outcomes"].values())
    print(f"requests: {total}")
    for kind in KINDS:
        outcomes = result["outcomes"].get(kind, {})
        lat = result["latency_s"].get(kind, {})
        p50 = "-" if lat.get("p50") is None else f"{1e3 * lat['p50']:.0f}"
        p99 = "-" if lat.get("p99") is None else f"{1e3 * lat['p99']:.0f}"
        print(f"  {kind:<10} {dict(sorted(outcomes.items()))}  latency p50 {p50} ms, p99 {p99} ms")
    rss = [r for _, r in result["rss_mib"]]
    print(f"RSS MiB: start {rss[0]:.0f}, after the first sample {rss[1] if len(rss) > 1 else rss[0]:.0f}, "
          f"max {max(rss):.0f}, end {rss[-1]:.0f}, median {statistics.median(rss):.0f}")
    print(f"after the traffic: running {result['after']['running']}, waiting {result['after']['waiting']}")
    print(f"finished by reason: {result['after']['finished']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=1800.0, help="seconds of traffic (default 1800)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--model", default="default")
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rss-every", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.json is not None and not args.json.parent.is_dir():
        ap.error(f"--json: the folder {args.json.parent} does not exist")

    proc, url = start_server(args)
    try:
        result = asyncio.run(soak(args, url, proc.pid))
    finally:
        proc.terminate()
        code = proc.wait(60)
    result["server_exit_code"] = code
    result["server_stderr_tail"] = list(STDERR_TAIL)
    report(result)
    print(f"server exit code after SIGTERM: {code}")
    print("the server's last stderr lines:\n" + "".join(STDERR_TAIL))
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(),
                                         "args": {k: str(v) for k, v in vars(args).items() if k != "json"},
                                         **result}, indent=2) + "\n")


if __name__ == "__main__":
    main()
