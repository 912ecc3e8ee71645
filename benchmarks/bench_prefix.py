"""Prefix caching benchmark (issue 18): what a hit saves and what caching costs.

    python benchmarks/bench_prefix.py [--model 0.8b|tiny] [--history 2000] [--json out.json]
    python benchmarks/bench_prefix.py --model tiny --history 200 --requests 4 --system 100   # smoke

Four measurements, each on a fresh engine per setting (caching off vs on):
- ttft: time to first token of a request whose prompt is a `--history`-token conversation
  already served once (the previous turn) plus a short new message; target >= 10x with caching.
- shared_system_prompt: `--requests` concurrent requests with a `--system`-token system prompt
  and short unique parts: aggregate tokens/s (prompt + generated) and prefill tokens computed.
- no_reuse: random prompts sharing nothing: wall time with caching on vs off (target <= 3%).
- checkpoint_cost: per checkpoint policy (prompt end only; every 256 / 512 tokens), the
  checkpoints taken, their bytes and the prefill time of one long prompt.

The 0.8B checkpoint is random weights at Qwen3.5-0.8B dims (benchmarks/random_checkpoint.py),
written once under --cache-dir. Timings are medians of --runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import time
from pathlib import Path

from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint


def model_folder(name: str, cache_dir: Path) -> str:
    if name == "tiny":
        from hybrid_engine.default_model import default_model_path
        return str(default_model_path())
    folder = cache_dir / "random-0.8b"
    if not (folder / "model.safetensors").exists():
        print(f"writing the random 0.8B checkpoint to {folder} (once)...", flush=True)
        write_random_checkpoint(folder, QWEN35_08B_CONFIG)
    return str(folder)


def make_engine(folder: str, dtype: str, prefix: bool, max_num_seqs: int, max_len: int, interval=None):
    from hybrid_engine import EngineConfig, LLMEngine
    return LLMEngine(EngineConfig(model=folder, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=max_len,
                                  max_num_batched_tokens=2048, enable_prefix_caching=prefix,
                                  prefix_checkpoint_interval=interval))


def run(engine, prompts, max_tokens: int) -> dict:
    """All prompts queued at once -> wall time, first-token times, tokens generated."""
    from hybrid_engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first, generated = {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                generated += len(o.token_ids)
    return {"wall_s": time.perf_counter() - t0, "ttft_s": statistics.median(first.values()),
            "generated": generated}


def tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def bench_ttft(folder, args, vocab) -> dict:
    out = {}
    for prefix in (False, True):
        times = []
        for r in range(args.runs):
            rng = random.Random(r)
            history = tokens(rng, args.history, vocab)
            engine = make_engine(folder, args.dtype, prefix, 4, args.history + 256)
            run(engine, [history], 1)                              # the previous turn
            times.append(run(engine, [history + tokens(rng, 24, vocab)], 1)["ttft_s"])
        out["on" if prefix else "off"] = statistics.median(times)
    out["speedup"] = out["off"] / out["on"]
    return out


def bench_shared_system(folder, args, vocab) -> dict:
    out = {}
    for prefix in (False, True):
        rows = []
        for r in range(args.runs):
            rng = random.Random(100 + r)
            system = tokens(rng, args.system, vocab)
            prompts = [system + tokens(rng, 40, vocab) for _ in range(args.requests)]
            engine = make_engine(folder, args.dtype, prefix, args.requests, args.system + 256)
            res = run(engine, prompts, args.new_tokens)
            stats = engine.prefix_cache_stats or {}
            computed = sum(map(len, prompts)) - stats.get("hit_tokens", 0)
            rows.append({"tok_s": (sum(map(len, prompts)) + res["generated"]) / res["wall_s"],
                         "prefill_tokens_computed": computed, "wall_s": res["wall_s"]})
        out["on" if prefix else "off"] = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
    out["throughput_ratio"] = out["on"]["tok_s"] / out["off"]["tok_s"]
    return out


def bench_no_reuse(folder, args, vocab) -> dict:
    out = {}
    for prefix in (False, True):
        walls = []
        for r in range(args.runs):
            rng = random.Random(200 + r)
            prompts = [tokens(rng, rng.randint(64, 512), vocab) for _ in range(args.requests)]
            engine = make_engine(folder, args.dtype, prefix, args.requests, 1024)
            walls.append(run(engine, prompts, args.new_tokens)["wall_s"])
        out["on" if prefix else "off"] = statistics.median(walls)
    out["overhead"] = out["on"] / out["off"] - 1
    return out


def bench_checkpoint_cost(folder, args, vocab) -> dict:
    out = {}
    for interval in (None, 256, 512):
        walls, taken, nbytes = [], 0, 0
        for r in range(args.runs):
            prompt = tokens(random.Random(300 + r), args.history, vocab)
            engine = make_engine(folder, args.dtype, True, 1, args.history + 64, interval)
            walls.append(run(engine, [prompt], 1)["wall_s"])
            stats = engine.prefix_cache_stats
            per = engine.cache.usage()["checkpoint_bytes_total"] // engine.cache.checkpoints.size
            taken, nbytes = stats["checkpoints_taken"], stats["checkpoints_taken"] * per
        out[f"every_{interval}" if interval else "prompt_end"] = {
            "prefill_s": statistics.median(walls), "checkpoints": taken, "bytes": nbytes}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["0.8b", "tiny"], default="0.8b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", nargs="+", default=["ttft", "shared_system_prompt", "no_reuse", "checkpoint_cost"])
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/hybrid-engine-bench"))
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    folder = model_folder(args.model, args.cache_dir)
    vocab = json.loads((Path(folder) / "config.json").read_text()).get("vocab_size") or \
        json.loads((Path(folder) / "config.json").read_text())["text_config"]["vocab_size"]
    benches = {"ttft": bench_ttft, "shared_system_prompt": bench_shared_system, "no_reuse": bench_no_reuse,
               "checkpoint_cost": bench_checkpoint_cost}
    load_start = os.getloadavg()[0]
    results = {}
    for name in args.only:
        results[name] = benches[name](folder, args, vocab)
        print(name, json.dumps(results[name], indent=1), flush=True)
    print(f"load average {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
            "dtype": args.dtype, "threads": args.threads, "args": {k: str(v) for k, v in vars(args).items()},
            "load_start": load_start, "load_end": os.getloadavg()[0], "results": results}, indent=1))


if __name__ == "__main__":
    main()
