"""Another tree's kernels/linear/blocked_linear.cpp against this tree's, in one process: the other
source is built into a library of its own (op namespace hybrid_engine_cpu_base, every other
source this tree's), and the engine's linear_blocked and mlp_blocked calls are switched
between the two per timed run. MTP on the default model: engines at k = 0 and k = K, each
prompt run with both builds and both engines in turn, so a pair of runs is a fraction of a
second apart. Separate processes minutes apart cannot settle a few percent on a host whose
speed swings by 10-30% (one round of per-process microbenchmarks read the same code 1.5x
slower than the next).

    python benchmarks/probes/ab_blocked_kernel.py OTHER_TREE [--k 4] [--rounds 10] [--out out.json]

First a check that the switch takes: the lm_head shape at 5 rows timed with each build. Then
the greedy tokens of both builds at both k are checked equal, and the pairs are timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu, random_checkpoint, ...

from bench_llamacpp import cpu_record  # noqa: E402

from mtp_pairs import add_arguments, load_prompts, quartiles, time_prompt  # noqa: E402

from hybrid_engine.cli import build_engine, sampling_params  # noqa: E402
from hybrid_engine.cli.bench import SteppedEngine  # noqa: E402
from hybrid_engine.kernels.linear.blocked import block_weight, blocked_linear, build, native_available  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402

SWITCHED = ("linear_blocked", "mlp_blocked")


class Switch:
    """Stands in for torch.ops.hybrid_engine_cpu: the switched ops from `other` while `use_other`."""

    def __init__(self, own, other):
        self.own, self.other, self.use_other = own, other, False

    def __getattr__(self, name):
        return getattr(self.other if self.use_other and name in SWITCHED else self.own, name)


def load_other(tree: Path):
    source = tree / "kernels" / "cpu" / "blocked_linear.cpp"
    if not source.exists():
        raise SystemExit(f"{source} does not exist")
    sources, namespace = build.SOURCES, build.namespace
    build.SOURCES = [source if s.name == source.name else s for s in sources]
    build.namespace = lambda level: "hybrid_engine_cpu_base"
    try:
        library = build._build.__wrapped__(cpu_level())      # not the cached own library
    finally:
        build.SOURCES, build.namespace = sources, namespace
    torch.ops.load_library(str(library))
    return torch.ops.hybrid_engine_cpu_base


def timed(f, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("other", type=Path, help="the other tree (e.g. a git worktree of the previous main)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", help="write the figures and every run's time here (JSON)")
    add_arguments(ap)           # the bench's prompts, sampling and engine flags
    args = ap.parse_args()
    if not native_available():
        raise SystemExit("no native kernels at this level: nothing to compare")
    switch = Switch(torch.ops.hybrid_engine_cpu, load_other(args.other))
    torch.ops.hybrid_engine_cpu = switch

    x, w = torch.randn(5, 192), block_weight(torch.randn(3072, 192))
    check = {}
    for use_other in (False, True, False, True):
        switch.use_other = use_other
        check.setdefault(use_other, []).append(timed(lambda: blocked_linear(x, w), 2000) * 1e6)
    print(f"lm_head shape, 5 rows: this tree {min(check[False]):.1f} us, other {min(check[True]):.1f} us")

    params = sampling_params(args, ignore_eos=True)
    engines = {k: SteppedEngine(build_engine(args, k)) for k in (0, args.k)}
    prompts = load_prompts(args, engines[0])
    tokens = set()
    for use_other in (False, True):
        switch.use_other = use_other
        for e in engines.values():
            tokens.add(tuple(tuple(o.outputs[0].token_ids) for o in e.generate(prompts, params)))
    if len(tokens) != 1:
        raise SystemExit("greedy tokens differ between the builds or the engines")
    times = {(b, k): [] for b in (False, True) for k in engines}
    for r in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for use_other in ((False, True) if (r + i) % 2 else (True, False)):
                switch.use_other = use_other
                for k in ((0, args.k) if i % 2 else (args.k, 0)):
                    times[(use_other, k)].append(time_prompt(engines[k], prompt, params))
    n, report = params.max_tokens, {}
    for use_other, name in ((True, "other"), (False, "this")):
        pairs = [a / b for a, b in zip(times[(use_other, 0)], times[(use_other, args.k)])]
        report[name] = {"k0_tok_s": n / statistics.median(times[(use_other, 0)]),
                        "k_tok_s": n / statistics.median(times[(use_other, args.k)]),
                        "median_pair_speedup": statistics.median(pairs)}
        print(f"{name} tree: k=0 {report[name]['k0_tok_s']:.1f} tok/s, k={args.k} {report[name]['k_tok_s']:.1f} "
              f"tok/s, MTP speedup {report[name]['median_pair_speedup']:.3f}x (median pair)")
    for k in engines:
        ratios = sorted(b / a for a, b in zip(times[(True, k)], times[(False, k)]))
        q = quartiles(ratios)
        report[f"k{k}_time_this_over_other"] = {"median": statistics.median(ratios), "quartiles": q}
        print(f"k={k}: time this / other {statistics.median(ratios):.3f} (quartiles {q[0]:.3f}-{q[1]:.3f}), "
              f"{len(ratios)} pairs")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), "cpu": cpu_record(), "other": str(args.other),
            "k": args.k, "max_tokens": n, "lm_head_5_rows_us": {"this": check[False], "other": check[True]},
            **report, "times_s": {f"{'other' if b else 'this'}_k{k}": v for (b, k), v in times.items()}},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
