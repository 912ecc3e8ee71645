"""HTTP serving benchmark (issue 19): `hybrid-engine serve` vs in-process `LLM.generate` on the
same requests, at several numbers of concurrent clients.

    python benchmarks/bench_serve.py [--model default|0.8b|FOLDER] [--clients 1,8,32] [--requests 4]
                                     [--prompt-len 32] [--max-tokens 64] [--threads 2] [--json out.json]

The server runs as a subprocess (`hybrid-engine serve --port 0`), so that its threads and the
clients' do not share one interpreter; the clients stream /v1/completions with httpx from this
process, each sending --requests requests one after another. Prompts are token ids (the
0.8B-dims checkpoint from random_checkpoint.py has no tokenizer) and every request generates
exactly --max-tokens tokens (ignore_eos). Reported per level: throughput (generated tokens /
wall time), TTFT and inter-token latency percentiles (client side for the server; the engine's
own per-request metrics in process), and the server's overhead per generated token,
(server wall - in-process wall) / tokens. In-process runs after the server has stopped, so the
two never compete for the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    values = sorted(values)

    def at(q: float) -> float:
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]
    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    # Distinct deterministic prompts, ids away from 0 (eos of the random checkpoint).
    return [[1 + (i * 7919 + j * 104729) % (vocab - 1) for j in range(length)] for i in range(n)]


# ---- the server --------------------------------------------------------------------------------

def start_server(args, model: str | None) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "serve", "--port", "0", "--log-level", "warning",
           "--served-model-name", "bench",
           "--max-num-seqs", str(max(args.clients_list)), "--dtype", args.dtype]
    if model is not None:
        cmd += ["--model", model]
    if args.speculative_tokens:
        cmd += ["--speculative-tokens", str(args.speculative_tokens)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    url = re.search(r"http://[\d.]+:\d+", proc.stderr.readline()).group(0)
    deadline = time.monotonic() + args.load_timeout
    while httpx.get(url + "/health").status_code != 200:
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError(f"the server did not become ready: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    return proc, url


async def one_request(http: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first, last, gaps, tokens = None, None, [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not (chunk["choices"] and chunk["choices"][0]["text"]):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gaps.append(now - last)
            last = now
    return {"ttft": first - start, "itl": gaps, "tokens": tokens, "e2e": time.perf_counter() - start}


async def run_clients(url: str, prompts: list[list[int]], clients: int, requests: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=clients)) as http:
        async def client(c: int) -> list[dict]:
            return [await one_request(http, url, prompts[(c * requests + r) % len(prompts)], max_tokens)
                    for r in range(requests)]
        await one_request(http, url, prompts[0], 2)   # warm-up
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*(client(c) for c in range(clients))) for r in rs]
        wall = time.perf_counter() - start
    tokens = sum(r["tokens"] for r in results)
    # a chunk may carry several tokens (MTP): its gap is shared by them
    itl = [g for r in results for g in r["itl"]]
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_s": percentiles([r["ttft"] for r in results]), "itl_s": percentiles(itl)}


# ---- in process --------------------------------------------------------------------------------

def run_in_process(llm, prompts, clients: int, requests: int, max_tokens: int) -> dict:
    """The same requests as `clients` callers of LLM.generate, each with its requests in turn,
    from threads (the engine loop batches them as it batches HTTP clients)."""
    from concurrent.futures import ThreadPoolExecutor

    from dataclasses import replace

    # the server's requests leave every other field to the same defaults (generation_config.json)
    params = replace(llm.get_default_sampling_params(), temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[0], replace(params, max_tokens=2), use_tqdm=False)   # warm-up

    def caller(c: int) -> list:
        return [llm.generate(prompts[(c * requests + r) % len(prompts)], params, use_tqdm=False)[0]
                for r in range(requests)]
    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        outs = [o for os_ in pool.map(caller, range(clients)) for o in os_]
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
            "ttft_s": percentiles([o.metrics["time_to_first_token"] for o in outs]),
            "itl_s": percentiles([o.metrics["time_per_output_token"] for o in outs
                                  if o.metrics["time_per_output_token"] is not None])}


# ---- main --------------------------------------------------------------------------------------

def resolve_model(name: str, tmp: Path) -> str | None:
    if name == "default":
        return None
    if name == "0.8b":
        from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint
        folder = tmp / "qwen35_08b_random"
        write_random_checkpoint(folder, QWEN35_08B_CONFIG)
        return str(folder)
    return name


def fmt(p: dict) -> str:
    return "/".join("-" if v is None else f"{1e3 * v:.1f}" for v in (p["p50"], p["p90"], p["p99"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default | 0.8b (random weights at Qwen3.5-0.8B dims) | FOLDER")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--requests", type=int, default=4, help="requests per client, one after another")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--speculative-tokens", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--load-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.clients_list = [int(c) for c in args.clients.split(",")]

    import torch
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model(args.model, Path(tmp))
        from hybrid_engine import LLM
        from hybrid_engine.models import load_config
        vocab = load_config(model).vocab_size if model is not None else 3072
        n_prompts = max(args.clients_list) * args.requests
        prompts = make_prompts(n_prompts, args.prompt_len, vocab)

        proc, url = start_server(args, model)
        try:
            server = {c: asyncio.run(run_clients(url, prompts, c, args.requests, args.max_tokens))
                      for c in args.clients_list}
        finally:
            proc.terminate()
            proc.wait(60)
        spec = ({"method": "mtp", "num_speculative_tokens": args.speculative_tokens}
                if args.speculative_tokens else None)
        llm = LLM(model=model, dtype=args.dtype, max_num_seqs=max(args.clients_list), speculative_config=spec,
                  max_num_batched_tokens=max(2048, max(args.clients_list) * (1 + args.speculative_tokens)))
        in_process = {c: run_in_process(llm, prompts, c, args.requests, args.max_tokens) for c in args.clients_list}
        llm.shutdown()

    print(f"{args.model} model, {args.dtype}, {args.threads} thread(s), prompts {args.prompt_len} tokens, "
          f"{args.max_tokens} generated per request, {args.requests} requests per client")
    print(f"{'clients':>7} | {'server tok/s':>12} | {'in-proc tok/s':>13} | {'overhead ms/tok':>15} | "
          f"{'server TTFT p50/90/99 ms':>24} | {'in-proc TTFT':>16} | {'server ITL p50/90/99 ms':>23} | {'in-proc ITL':>16}")
    rows = []
    for c in args.clients_list:
        s, p = server[c], in_process[c]
        overhead = (s["wall_s"] - p["wall_s"]) / max(s["tokens"], 1)
        rows.append({"clients": c, "server": s, "in_process": p, "overhead_s_per_token": overhead})
        print(f"{c:>7} | {s['tok_s']:>12.1f} | {p['tok_s']:>13.1f} | {1e3 * overhead:>15.3f} | "
              f"{fmt(s['ttft_s']):>24} | {fmt(p['ttft_s']):>16} | {fmt(s['itl_s']):>23} | {fmt(p['itl_s']):>16}")
    print(f"load average {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "model": args.model,
                                         "args": {k: v for k, v in vars(args).items() if k != "json"},
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
