"""Engine overhead benchmark (issue 3): steps/s, tokens/s and the share of each decode step spent
outside the model forward (scheduling, input building, sampling, bookkeeping), at batch 1 and 16
on the tiny default model, where a step is almost all overhead.

    python benchmarks/bench_engine.py [--threads 1] [--steps 256] [--runs 5] [--json out.json]

Uses the packaged default model. Medians of --runs;
each run is a fresh set of requests with 32-token prompts, timed after their prefill step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
from pathlib import Path

from bench_cpu import engine_decode, make_engine

from hybrid_engine.default_model import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false",
                    help="prefix caching off (on by default, as in the engine); for A/B against trees without it")
    args = ap.parse_args()

    import torch
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()[0]
    engine = make_engine(str(default_model_path()), "float32", 16, prefix_caching=args.prefix_caching)
    vocab = engine.model_config.vocab_size
    engine_decode(engine, 1, 8, vocab)                        # warm-up
    rows = []
    print(f"default (tiny) model, float32, prefix caching {'on' if args.prefix_caching else 'off'}, {args.threads} thread(s), {args.steps} decode steps, median of {args.runs}")
    print(f"{'batch':>5} | {'steps/s':>8} | {'tokens/s':>8} | {'step ms':>7} | {'forward ms':>10} | {'outside':>7}")
    for b in [int(x) for x in args.batches.split(",")]:
        runs = [engine_decode(engine, b, args.steps, vocab) for _ in range(args.runs)]
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rows.append({"batch": b, "steps_per_s": 1e3 / med["step_ms"], **med, "runs": runs})
        print(f"{b:>5} | {1e3 / med['step_ms']:>8.1f} | {med['tok_s']:>8.1f} | {med['step_ms']:>7.3f} | "
              f"{med['forward_ms']:>10.3f} | {100 * med['outside_share']:>6.1f}%")
    print(f"load average {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "threads": args.threads,
            "load_start": load_start, "load_end": os.getloadavg()[0], "results": rows}, indent=1))


if __name__ == "__main__":
    main()
