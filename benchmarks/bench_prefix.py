"""Prefix caching benchmark (issue 18): what a hit saves and what caching costs.

    python benchmarks/bench_prefix.py --model default --runs 1     # the embedded model, the issue's sizes
    python benchmarks/bench_prefix.py --model default --runs 1 --history 600 --system 300 --requests 8 --decode-tokens 64
    python benchmarks/bench_prefix.py --model 0.8b --only ttft --runs 2 --threads 2
    python benchmarks/bench_prefix.py --model 0.8b --only shared_system_prompt --runs 1 --requests 16 --system 1000
    python benchmarks/bench_prefix.py --model 0.8b --only checkpoint_cost --runs 1 --history 1024

Four measurements (--only picks some), each on a fresh engine per setting (caching off vs on):
- ttft: time to first token of a request whose prompt is a `--history`-token conversation
  already served once (the previous turn) plus a short new message; target >= 10x with caching.
- shared_system_prompt: `--requests` concurrent requests with a `--system`-token system prompt
  and 40-token unique parts: aggregate tokens/s (prompt + generated), wall time, and prefill
  tokens computed against the ideal (the system prompt once + the unique parts).
- no_reuse: random prompts sharing nothing: wall time with caching on vs off (target <= 3%).
- checkpoint_cost: per checkpoint policy, the same workload with caching off and on: wall time,
  steps, checkpoints taken (at prefill vs while decoding), bytes per checkpoint and the time
  of each checkpoint copy while decoding (PrefixStore.save_checkpoint, timed around each
  call; a prefill's checkpoints are written by its forward, their cost is in the wall time).
  Policies: prompt_end (one `--history`-token prompt), branch_points (`--branches` prompts
  sharing their first half, queued together: with caching on they also hit that half, so
  its wall time holds the savings too), every_512 / every_256 (one prompt with
  prefix_checkpoint_interval), decode (a 64-token prompt generating `--decode-tokens` tokens:
  one checkpoint per block boundary crossed).

--model 0.8b is random weights at Qwen3.5-0.8B dims (benchmarks/random_checkpoint.py), written
once under --cache-dir; --model default (alias tiny) is the embedded model (192 hidden, 8
layers): the same code paths in minutes (the second command above: about one), for checking
the script and the ratios of counts.
Timings are medians of --runs. A table is printed; the JSON goes to --json, by default
benchmarks/results/bench_prefix_<only>_<model>_<date>.json.
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
    if name in ("default", "tiny"):
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
    """All prompts queued at once -> wall time, first-token times, tokens generated, steps."""
    from hybrid_engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    first, generated, steps = {}, 0, 0
    while engine.has_unfinished_requests():
        steps += 1
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
            if o.finished:
                generated += len(o.token_ids)
    return {"wall_s": time.perf_counter() - t0, "ttft_s": statistics.median(first.values()),
            "generated": generated, "steps": steps}


def time_checkpoint_copies(engine) -> list[tuple[bool, float]]:
    """Wraps the engine's save_checkpoint: each taken checkpoint appends (pending, seconds).
    pending: taken while decoding (the request's own, published when it ends)."""
    store, copies = engine.cache.prefix_store, []
    save = store.save_checkpoint

    def timed(*args, pending=False, **kwargs):
        t0 = time.perf_counter()
        taken = save(*args, pending=pending, **kwargs)
        if taken:
            copies.append((pending, time.perf_counter() - t0))
        return taken

    store.save_checkpoint = timed
    reserve = store.reserve_checkpoint

    def counted(*args, **kwargs):
        # A prefill's checkpoints are written by its own forward (ForwardBatch.gdn_captures):
        # no copy to time, their cost is inside the forward (on_s); counted as 0 s here.
        entry = reserve(*args, **kwargs)
        if entry is not None:
            copies.append((False, 0.0))
        return entry

    store.reserve_checkpoint = counted
    return copies


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
            ideal = len(system) + 40 * len(prompts)
            rows.append({"tok_s": (sum(map(len, prompts)) + res["generated"]) / res["wall_s"],
                         "wall_s": res["wall_s"], "steps": res["steps"], "prefill_tokens_computed": computed,
                         "computed_over_ideal": computed / ideal})
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


def checkpoint_policies(args, vocab, r: int) -> dict[str, tuple[list[list[int]], int, int | None]]:
    """policy -> (prompts queued together, tokens generated each, prefix_checkpoint_interval)."""
    rng = random.Random(300 + r)
    prompt = tokens(rng, args.history, vocab)
    shared = prompt[:args.history // 2]
    branches = [shared + tokens(rng, args.history - len(shared), vocab) for _ in range(args.branches)]
    return {"prompt_end": ([prompt], 1, None), "branch_points": (branches, 1, None),
            "every_512": ([prompt], 1, 512), "every_256": ([prompt], 1, 256),
            "decode": ([tokens(rng, 64, vocab)], args.decode_tokens, None)}


def bench_checkpoint_cost(folder, args, vocab) -> dict:
    out = {}
    for name in checkpoint_policies(args, vocab, 0):
        rows = []
        for r in range(args.runs):
            prompts, new_tokens, interval = checkpoint_policies(args, vocab, r)[name]
            max_len = max(map(len, prompts)) + new_tokens + 64
            off = run(make_engine(folder, args.dtype, False, len(prompts), max_len), prompts, new_tokens)
            engine = make_engine(folder, args.dtype, True, len(prompts), max_len, interval)
            copies = time_checkpoint_copies(engine)
            on = run(engine, prompts, new_tokens)
            seconds = [t for p, t in copies if p]
            rows.append({"off_s": off["wall_s"], "on_s": on["wall_s"], "overhead": on["wall_s"] / off["wall_s"] - 1,
                         "steps_off": off["steps"], "steps_on": on["steps"],
                         "prefill_checkpoints": sum(not p for p, _ in copies),
                         "decode_checkpoints": sum(p for p, _ in copies),
                         "copy_ms": 1e3 * statistics.median(seconds) if seconds else 0.0,
                         "copy_total_s": sum(seconds)})
        per = engine.cache.usage()["checkpoint_bytes_total"] // engine.cache.prefix_store.checkpoints.size
        out[name] = {"bytes_per_checkpoint": per,
                     **{k: statistics.median(row[k] for row in rows) for k in rows[0]}}
    return out


TABLE_COLUMNS = {   # bench -> the columns of its printed table (flattened result keys)
    "ttft": ["off", "on", "speedup"],
    "shared_system_prompt": ["off.tok_s", "on.tok_s", "throughput_ratio", "off.wall_s", "on.wall_s",
                             "off.prefill_tokens_computed", "on.prefill_tokens_computed", "on.computed_over_ideal"],
    "no_reuse": ["off", "on", "overhead"],
    "checkpoint_cost": ["bytes_per_checkpoint", "prefill_checkpoints", "decode_checkpoints", "copy_ms",
                        "copy_total_s", "off_s", "on_s", "overhead", "steps_off", "steps_on"],
}


def print_table(name: str, result: dict) -> None:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    def get(d, key):
        for part in key.split("."):
            d = d[part]
        return d

    cols = TABLE_COLUMNS[name]
    rows = result.items() if name == "checkpoint_cost" else [(name, result)]
    print(f"\n{name}\n| {' | '.join(['', *cols])} |\n|{'---|' * (len(cols) + 1)}")
    for label, row in rows:
        print(f"| {label} | {' | '.join(fmt(get(row, c)) for c in cols)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["0.8b", "default", "tiny"], default="0.8b")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--history", type=int, default=2000)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--branches", type=int, default=4, help="checkpoint_cost's branch_points prompts")
    ap.add_argument("--decode-tokens", type=int, default=256, help="checkpoint_cost's decode policy")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--only", nargs="+", choices=list(TABLE_COLUMNS), default=list(TABLE_COLUMNS))
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
        print_table(name, results[name])
    print(f"load average {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    which = "all" if args.only == list(TABLE_COLUMNS) else "+".join(args.only)
    path = args.json or (Path(__file__).parent / "results" /
                         f"bench_prefix_{which}_{args.model}_{datetime.date.today().isoformat()}.json")
    print(f"JSON: {path}")
    path.write_text(json.dumps({
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "model": args.model,
        "dtype": args.dtype, "threads": args.threads, "args": {k: str(v) for k, v in vars(args).items()},
        "load_start": load_start, "load_end": os.getloadavg()[0], "results": results}, indent=1))


if __name__ == "__main__":
    main()
