"""MTP speedup over plain decoding, measured in pairs: engines for k = 0 and each k given, all
loaded in one process, each prompt (the bench's, or --prompts) run by every engine in turn (the
order rotated), so each prompt and round gives a ratio t(k=0) / t(k) from runs a fraction of a
second apart.

`hybrid-engine bench` times each k over all prompts (about a second) and interleaves the k
values per repeat; on a shared host whose speed swings by 10-30% within seconds its best-k
figure then moves by +-10% between runs of the same tree. The median of these pair ratios
moved by about +-3%.

    python benchmarks/mtp_pairs.py --ks 3,4,5 --rounds 6 [--dtype bfloat16] [--json out.json]

Greedy, --max-tokens per prompt with end-of-sequence ignored (as the bench), batch 1, the
engines stepped on this thread (hybrid_engine/cli/bench.py SteppedEngine). Every k's tokens are checked equal to
k = 0's first.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_llamacpp import cpu_record  # noqa: E402

from hybrid_engine.cli import (add_engine_arguments, add_sampling_arguments, build_engine,  # noqa: E402
                               encode_prompts, read_prompt_file, sampling_params)
from hybrid_engine.cli.bench import BUILTIN_PROMPTS, SteppedEngine  # noqa: E402


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The prompts, sampling and engine flags as the bench takes them (not its --max-k etc.)."""
    ap.add_argument("--prompts", metavar="FILE", help="as the bench takes them (default: its code prompts)")
    add_sampling_arguments(ap, max_tokens=64, full=False)
    add_engine_arguments(ap)


def load_prompts(args, engine: SteppedEngine) -> list:
    return encode_prompts(engine, read_prompt_file(args.prompts)[0] if args.prompts else BUILTIN_PROMPTS)


def time_prompt(engine: SteppedEngine, prompt, params) -> float:
    """Seconds for one request of `prompt`, prefilled afresh (no hit in the prefix cache)."""
    engine.reset_prefix_cache()
    start = time.perf_counter()
    engine.generate([prompt], params)
    return time.perf_counter() - start


def quartiles(ordered: list[float]) -> list[float]:
    return [ordered[len(ordered) // 4], ordered[3 * len(ordered) // 4]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="3,4,5", help="draft lengths against k = 0")
    ap.add_argument("--rounds", type=int, default=6, help="passes over the prompts")
    ap.add_argument("--json", help="write the figures and every pair's times here")
    add_arguments(ap)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    if not ks or any(not 1 <= k <= 8 for k in ks) or args.rounds < 1:
        ap.error("--ks must list draft lengths in 1..8 and --rounds must be >= 1")
    params = sampling_params(args, ignore_eos=True)
    engines = {k: SteppedEngine(build_engine(args, k)) for k in [0, *ks]}
    prompts = load_prompts(args, engines[0])
    reference = [o.outputs[0].token_ids for o in engines[0].generate(prompts, params)]
    for k in ks:                          # also the warm-up
        if [o.outputs[0].token_ids for o in engines[k].generate(prompts, params)] != reference:
            raise SystemExit(f"k={k}: greedy tokens differ from k=0's")
    times = {k: [] for k in engines}
    order = list(engines)
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            turn = (r + i) % len(order)
            for k in order[turn:] + order[:turn]:
                times[k].append(time_prompt(engines[k], prompt, params))
    n = params.max_tokens
    rows = []
    for k in ks:
        ratios = sorted(a / b for a, b in zip(times[0], times[k]))
        rows.append({"k": k, "median_pair_speedup": statistics.median(ratios),
                     "quartiles": quartiles(ratios),
                     "total_time_speedup": sum(times[0]) / sum(times[k]),
                     "median_tok_s": n / statistics.median(times[k]), "pairs": len(ratios)})
    print(f"k=0: {n / statistics.median(times[0]):.1f} tok/s (median prompt), "
          f"{len(prompts)} prompts x {n} tokens x {args.rounds} rounds")
    for row in rows:
        print(f"k={row['k']}: {row['median_pair_speedup']:.3f}x median pair "
              f"(quartiles {row['quartiles'][0]:.3f}-{row['quartiles'][1]:.3f}), "
              f"total time {row['total_time_speedup']:.3f}x, {row['median_tok_s']:.1f} tok/s")
    best = max(rows, key=lambda row: row["median_pair_speedup"])
    print(f"best: k={best['k']}, {best['median_pair_speedup']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), "cpu": cpu_record(),
            "model": args.model, "dtype": args.dtype, "max_tokens": n, "rows": rows,
            "k0_median_tok_s": n / statistics.median(times[0]),
            "times_s": {str(k): v for k, v in times.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
