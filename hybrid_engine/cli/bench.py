"""`hybrid-engine bench`: MTP speculative decoding against plain decoding on the same prompts."""

from __future__ import annotations

import copy
import statistics
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from . import (CLIError, add_engine_arguments, add_sampling_arguments, build_engine, check_output_path, console,
                  dtype_name, encode_prompts, read_prompt_file, sampling_params, write_json)

if TYPE_CHECKING:
    from hybrid_engine.spec_decode.stats import SpecStats

NAME = "bench"
HELP = "MTP speculative-decoding benchmark"
DESCRIPTION = """\
Runs the same prompts without speculation and with k = 1..--max-k MTP draft tokens (one
engine each, all loaded at once), after a warm-up run per engine, --repeats times each with
the k values interleaved (medians reported). Greedy by default; every request generates
--max-tokens tokens (end-of-sequence is ignored) so all runs do equal work. Prompts are sent
--batch-size at a time (default 1: latency at batch 1).

  hybrid-engine bench
  hybrid-engine bench --max-k 4 --max-tokens 128 --json bench.json --plot bench.png
  hybrid-engine bench --model ./ckpt --prompts prompts.jsonl
"""

# Hand-written, code-like, and not taken from any source the embedded model was trained on
# (the Python standard library): held-out prompts for the drafter.
BUILTIN_PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n',
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n    if argv is None:\n        argv = sys.argv[1:]\n",
    "def read_settings(path):\n    settings = {}\n    with open(path) as f:\n        for line in f:\n"
    "            line = line.strip()\n            if not line or line.startswith('#'):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
    "        mid = (lo + hi) // 2\n",
    'class Point:\n    """A point in the plane."""\n\n    def __init__(self, x, y):\n        self.x = x\n'
    "        self.y = y\n\n    def __repr__(self):\n",
    "def parse_int(text, default=None):\n    try:\n        return int(text)\n    except ValueError:\n",
    "def count_words(lines):\n    counts = {}\n    for line in lines:\n        for word in line.split():\n",
]


def add_arguments(parser) -> None:
    parser.add_argument("--prompts", default=None, metavar="FILE",
                        help="prompts, JSONL with a \"prompt\" field or one per line (default: built-in code prompts)")
    parser.add_argument("--max-k", type=int, default=3, help="largest number of draft tokens (default: 3)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per k; medians are reported (default: 3)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts sent together (default: 1)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON ('-' = stdout)")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="plot speedup and acceptance against k (needs matplotlib)")
    add_sampling_arguments(parser, max_tokens=64, full=False)
    add_engine_arguments(parser)


@dataclass
class Measured:
    k: int
    walls: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)       # mean per repeat
    tpot: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)  # token ids of the first repeat
    stats: SpecStats | None = None                          # over the timed runs


def run(args) -> int:
    from tqdm.auto import tqdm

    if not 1 <= args.max_k <= 8:
        raise CLIError(f"--max-k must be in 1..8, got {args.max_k}")
    for flag, value in (("--repeats", args.repeats), ("--batch-size", args.batch_size)):
        if value < 1:
            raise CLIError(f"{flag} must be >= 1, got {value}")
    check_output_path("--json", args.json, stdout_ok=True)
    check_output_path("--plot", args.plot)
    params = sampling_params(args, ignore_eos=True)
    raw = read_prompt_file(args.prompts)[0] if args.prompts else BUILTIN_PROMPTS
    ks = list(range(args.max_k + 1))
    num_batches = -(-len(raw) // args.batch_size)
    bar = tqdm(total=len(ks) * (1 + args.repeats * num_batches), desc="bench", unit="run",
               file=sys.stderr, disable=None)   # None: no bar when stderr is not a terminal
    try:
        # One tensor-parallel engine per process: under tensor parallelism the k values run one
        # after another, each engine shut down before the next starts.
        groups = [[k] for k in ks] if getattr(args, "tensor_parallel_size", 1) > 1 else [ks]
        results, described = {}, None
        for group in groups:
            llms, prompts = _load_and_warm_up(args, group, raw, params, bar)
            results.update(_measure(llms, group, prompts, params, args, bar))
            engine = llms[group[0]].engine
            described = described or (engine.config.model, dtype_name(engine))
            if len(groups) > 1:
                engine.shutdown()
    finally:
        bar.close()
    report = _report([results[k] for k in ks], params, args, described, len(prompts))
    if args.json != "-":
        _print_table(report)
    if args.json:
        write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


class SteppedEngine:
    """An engine stepped on the bench's own thread, with the part of LLM's API the bench uses.
    Not LLM: each LLM's loop thread would be one more thread running torch's parallel ops, and
    with several alive every engine's small steps ran at half speed (hybrid_engine/engine_loop.py)."""

    def __init__(self, engine):
        self.engine = engine
        self.tokenizer = engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def generate(self, prompts, params, use_tqdm: bool = False) -> list:
        ids = [self.engine.add_request(p, params) for p in prompts]
        final = {}
        while len(final) < len(ids):
            final.update((out.request_id, out) for out in self.engine.step() if out.finished)
        return [final[i] for i in ids]


def _load_and_warm_up(args, ks: list[int], raw: list, params, bar) -> tuple[dict, list]:
    """-> ({k: SteppedEngine}, the prompts as the engines take them), each engine run once."""
    llms = {}
    for k in ks:
        bar.set_description(f"bench: warm-up k={k}")
        llms[k] = SteppedEngine(build_engine(args, k))
        if k == ks[0]:
            # A model without mtp.* weights fails at the first k > 0 (LLMEngine's ValueError):
            # the k = 0 engine no longer loads the MTP head, so it cannot tell.
            if llms[k].tokenizer is None and not args.prompts:
                raise CLIError("the model has no tokenizer: give token-id prompts with --prompts FILE.jsonl")
            prompts = encode_prompts(llms[k], raw)
        if args.torch_compile:      # one whole untimed run: every compiled shape gets made here
            llms[k].generate(prompts, params, use_tqdm=False)
        else:
            llms[k].generate(prompts[:args.batch_size], replace(params, max_tokens=min(params.max_tokens, 8)),
                             use_tqdm=False)
        bar.update(1)
    return llms, prompts


def _measure(llms: dict, ks: list[int], prompts, params, args, bar) -> dict:
    results = {k: Measured(k) for k in ks}
    before = {k: copy.deepcopy(llms[k].engine.spec_stats) for k in ks if k}
    # Repeats interleave the k values, so that load from elsewhere on the machine
    # spreads over all of them instead of skewing one.
    for _ in range(args.repeats):
        for k in ks:
            bar.set_description(f"bench k={k}")
            _timed_run(llms[k], prompts, params, args.batch_size, results[k], bar)
    for k in before:
        results[k].stats = _stats_since(before[k], llms[k].engine.spec_stats)
    return results


def _timed_run(llm, prompts, params, batch_size: int, m: Measured, bar) -> None:
    # Every repeat prefills its prompts: none is served from the previous repeat's prefix cache.
    llm.reset_prefix_cache()
    outs, start = [], time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outs += llm.generate(prompts[i:i + batch_size], params, use_tqdm=False)
        bar.update(1)
    m.walls.append(time.perf_counter() - start)
    m.tokens.append(sum(len(o.token_ids) for o in outs))
    m.ttft.append(_mean(o.metrics["time_to_first_token"] for o in outs))
    m.tpot.append(_mean(o.metrics["time_per_output_token"] for o in outs))
    if not m.outputs:
        m.outputs = [o.token_ids for o in outs]


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _stats_since(before, after):
    from hybrid_engine.spec_decode.stats import SpecStats

    return SpecStats(after.num_speculative_tokens, after.num_verify_steps - before.num_verify_steps,
                     after.num_drafted - before.num_drafted, after.num_accepted - before.num_accepted,
                     [a - b for a, b in zip(after.accepted_per_position, before.accepted_per_position)])


def _report(results: list[Measured], params, args, model: tuple[str, str], num_prompts: int) -> dict:
    """model: (folder, dtype)."""
    import torch

    from ..kernels.native.isa import cpu_level, detected_level

    base = results[0]
    base_wall = _median(base.walls)
    rows = []
    for m in results:
        wall = _median(m.walls)
        differing = sum(a != b for a, b in zip(m.outputs, base.outputs))
        rows.append({
            "k": m.k,
            "acceptance_rate_per_position": m.stats.acceptance_rate_per_position if m.stats else [],
            "acceptance_rate": m.stats.acceptance_rate if m.stats else None,
            "mean_accept_length": m.stats.mean_accept_length if m.stats else 1.0,
            "output_tokens_per_s": _median(t / w for t, w in zip(m.tokens, m.walls)),
            "time_to_first_token_ms": _ms(_median(m.ttft)),
            "time_per_output_token_ms": _ms(_median(m.tpot)),
            "wall_s": wall,
            "speedup": base_wall / wall,
            "greedy_identical": (differing == 0) if params.is_greedy else None,
            "num_prompts_differing": differing,
        })
    best = max(rows[1:], key=lambda r: r["speedup"])
    return {
        "model": model[0], "dtype": model[1], "device": args.device, "num_prompts": num_prompts,
        "prompts": args.prompts or "built-in", "max_tokens": params.max_tokens,
        "temperature": params.temperature, "repeats": args.repeats, "batch_size": args.batch_size,
        "torch_version": torch.__version__, "torch_threads": torch.get_num_threads(),
        # The instruction-set level the CPU kernels ran at (kernels/native/isa.py) and the CPU's own:
        # a figure means little without it (an AVX2 and an AVX-512 machine differ 2x).
        "cpu_level": cpu_level(), "cpu_detected_level": detected_level(),
        "results": rows, "best_k": best["k"], "best_speedup": best["speedup"],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _print_table(report: dict) -> None:
    from rich.table import Table

    mode = "greedy" if report["temperature"] == 0 else f"temperature {report['temperature']}"
    table = Table(title=f"MTP speculative decoding: {report['model']}\n{report['num_prompts']} prompts x "
                        f"{report['max_tokens']} tokens, {mode}, batch {report['batch_size']}, "
                        f"median of {report['repeats']}")
    for name in ("k", "accept rate / draft pos", "mean accept len", "tok/s", "TTFT ms", "TPOT ms",
                 "wall s", "speedup", "greedy identical"):
        table.add_column(name, justify="left" if name.startswith("accept") else "right")
    for r in report["results"]:
        identical = {True: "yes", False: f"NO ({r['num_prompts_differing']} differ)", None: "n/a"}
        table.add_row(
            str(r["k"]), " ".join(f"{a:.2f}" for a in r["acceptance_rate_per_position"]) or "-",
            f"{r['mean_accept_length']:.2f}", f"{r['output_tokens_per_s']:.1f}", _fmt(r["time_to_first_token_ms"]),
            _fmt(r["time_per_output_token_ms"]), f"{r['wall_s']:.2f}", f"{r['speedup']:.2f}x",
            identical[r["greedy_identical"]] if r["k"] else "(reference)")
    out = console()
    out.print(table)
    level = f" (CPU level {report['cpu_level']})" if report["device"] == "cpu" else ""
    out.print(f"best: k={report['best_k']}, {report['best_speedup']:.2f}x wall-clock over no speculation{level}")


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _plot(report: dict, path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("hybrid-engine: matplotlib is not installed (pip install 'hybrid-engine[bench]'); no plot written",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    ks = [r["k"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(ks, [r["speedup"] for r in rows], "o-")
    left.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    left.set(xlabel="draft tokens k", ylabel="wall-clock speedup", title="Speedup over no speculation",
             xticks=ks)
    spec = rows[1:]
    for j in range(len(spec[-1]["acceptance_rate_per_position"])):
        pts = [(r["k"], r["acceptance_rate_per_position"][j]) for r in spec if j < r["k"]]
        right.plot(*zip(*pts), "o-", label=f"draft position {j + 1}")
    right.set(xlabel="draft tokens k", ylabel="acceptance rate", ylim=(0, 1.05), xticks=ks[1:],
              title="Acceptance per draft position")
    twin = right.twinx()
    twin.plot(ks[1:], [r["mean_accept_length"] for r in spec], "k--s", label="mean accept length")
    twin.set(ylabel="mean accept length (tokens per verify)", ylim=(1, ks[-1] + 1.05))
    lines = right.get_legend_handles_labels()
    extra = twin.get_legend_handles_labels()
    right.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=8, ncol=2, loc="upper center",
                 bbox_to_anchor=(0.5, -0.18))
    fig.suptitle(f"{Path(report['model']).name}: {report['num_prompts']} prompts x {report['max_tokens']} tokens, "
                 f"{report['dtype']}, {report['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    print(f"plot written to {path}", file=sys.stderr)
