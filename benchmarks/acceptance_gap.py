"""MTP draft acceptance of quantized weights against float, per draft position, with a standard
error: the prompts are split into S interleaved subsets, `hybrid-engine bench` runs each subset
for the float model and for each quantization, and the gap (float - quantized) is taken per
subset, where both sides start from the same prompts, then its mean and standard error over the
subsets. Greedy text drifts apart once one token differs, so one run's per-position gap on 64
prompts x 128 tokens has a spread of about 0.03 at the last positions of k = 4 (between this
script's subsets of the default model): more than the 0.02 it is meant to resolve.

    python benchmarks/acceptance_gap.py [--prompts FILE.jsonl | --make-prompts N] [--subsets 8]
        [--model DIR] [--quantization int8 int4] [--against DIR ...] [--max-k 4] [--max-tokens 128]
        [--float-from REPORT.json] [--json OUT]

--against DIR: also checkpoints stored quantized (`hybrid-engine quantize`'s output, a GGUF
file) or other copies of --model's weights, each run as stored and compared with --model.

--float-from REPORT.json: the float run's rates from an earlier report of the same prompts,
subsets, k and tokens (greedy and deterministic: a rerun gives the same digits), not run again.

--make-prompts N: N prompts of 300 characters from the default model's held-out stdlib files
(examples/train_default_model.py: the split depends on the Python version), each starting at
the first line start at or after i / N of their text; written beside --json as
prompts_N.jsonl. Results in benchmarks/RESULTS.md (issue 39).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT_CHARS = 300


def make_prompts(n: int) -> list[str]:
    sys.path.insert(0, str(REPO / "examples"))
    import train_default_model as T
    _, held = T.stdlib_files()
    text = "\n".join(T.read_texts(held))
    starts = [text.find("\n", i * len(text) // n) for i in range(n)]
    return [text[s:s + PROMPT_CHARS] for s in starts if s >= 0]


def per_position(report: dict) -> dict[int, list[float]]:
    """A `hybrid-engine bench --json` report -> k -> acceptance rate per draft position."""
    return {r["k"]: r["acceptance_rate_per_position"] for r in report["results"] if r["k"] > 0}


def gaps(base: list[dict[int, list[float]]], runs: list[dict[int, list[float]]]) -> dict[int, list[tuple[float, float]]]:
    """Per subset rates of the float and the quantized runs (same subsets, same order) -> k ->
    (mean gap, standard error of the mean) per draft position; the gap is float - quantized."""
    if len(base) != len(runs) or len(base) < 2:
        raise ValueError(f"need the same two or more subsets on both sides, not {len(base)} and {len(runs)}")
    out = {}
    for k in sorted(base[0]):
        cells = []
        for j in range(k):
            g = [b[k][j] - r[k][j] for b, r in zip(base, runs)]
            cells.append((statistics.mean(g), statistics.stdev(g) / len(g) ** 0.5))
        out[k] = cells
    return out


def largest(table: dict[int, list[tuple[float, float]]]) -> tuple[float, float, int, int]:
    """(gap, its standard error, k, position from 1) of the largest mean gap."""
    return max((m, se, k, j + 1) for k, cells in table.items() for j, (m, se) in enumerate(cells))


def run_bench(prompts: Path, out: Path, args, model: str | None, quantization: str | None) -> dict[int, list[float]]:
    cmd = [sys.executable, "-m", "hybrid_engine.cli", "bench", "--prompts", str(prompts), "--max-k", str(args.max_k),
           "--repeats", "1", "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
           "--json", str(out)]
    if model:
        cmd += ["--model", model]
    if quantization:
        cmd += ["--quantization", quantization]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return per_position(json.loads(out.read_text()))


def earlier_float_rates(path: str, lines: list[str], args) -> list:
    """The float run's rates per subset from an earlier report, which must have run these prompts
    in the same subsets, k and tokens (SystemExit naming what differs)."""
    earlier = json.loads(Path(path).read_text())
    source = earlier["prompts"]
    same_prompts = (source == (args.prompts or f"made: {len(lines)}") if not source.startswith("made:")
                    else args.make_prompts == earlier["num_prompts"])
    checks = {"prompts": same_prompts, "num_prompts": earlier["num_prompts"] == len(lines),
              "subsets": earlier["subsets"] == args.subsets, "max_tokens": earlier["max_tokens"] == args.max_tokens,
              "model": earlier["model"] == (args.model or "default"),
              "k": sorted(map(int, earlier["rates"]["float"][0])) == list(range(1, args.max_k + 1))}
    differ = [name for name, same in checks.items() if not same]
    if differ:
        raise SystemExit(f"--float-from {path}: its {', '.join(differ)} differ from this run's")
    return [{int(k): rates for k, rates in subset.items()} for subset in earlier["rates"]["float"]]   # JSON's keys are str


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help="a .jsonl of {\"prompt\": ...} lines")
    source.add_argument("--make-prompts", type=int, metavar="N")
    ap.add_argument("--subsets", type=int, default=8)
    ap.add_argument("--model", default=None, help="default: the embedded default model")
    ap.add_argument("--quantization", nargs="*", default=["int8", "int4"])
    ap.add_argument("--against", nargs="*", default=[], metavar="DIR")
    ap.add_argument("--max-k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--float-from", metavar="REPORT.json")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    if args.prompts:
        lines = Path(args.prompts).read_text().splitlines()
    else:
        lines = [json.dumps({"prompt": p}) for p in make_prompts(args.make_prompts)]
        if args.json:
            Path(args.json).with_name(f"prompts_{len(lines)}.jsonl").write_text("\n".join(lines) + "\n")
    if len(lines) < 2 * args.subsets:
        raise SystemExit(f"{len(lines)} prompts are too few for {args.subsets} subsets")
    # name -> (model, quantization): the float run first, then each run compared with it
    runs = {"float": (args.model, None), **{q: (args.model, q) for q in args.quantization},
            **{str(m): (str(m), None) for m in args.against}}
    rates: dict[str, list] = {}
    if args.float_from:
        rates["float"] = earlier_float_rates(args.float_from, lines, args)
    with tempfile.TemporaryDirectory(prefix="acceptance-gap-") as work:
        for s in range(args.subsets):
            subset = Path(work) / f"subset{s}.jsonl"
            subset.write_text("\n".join(lines[s::args.subsets]) + "\n")
            for i, (name, (model, q)) in enumerate(runs.items()):
                if name in rates and len(rates[name]) == args.subsets:
                    continue
                rates.setdefault(name, []).append(run_bench(subset, Path(work) / f"run{i}-{s}.json", args, model, q))
                print(f"subset {s + 1}/{args.subsets} {name} done", file=sys.stderr, flush=True)
    report = {"prompts": args.prompts or f"made: {len(lines)}", "num_prompts": len(lines), "subsets": args.subsets,
              "max_tokens": args.max_tokens, "model": args.model or "default", "rates": rates, "gaps": {}}
    base = rates["float"]
    print("float:", " | ".join(" ".join(f"{statistics.mean(r[k][j] for r in base):.3f}" for j in range(k))
                               for k in sorted(base[0])))
    for q in list(runs)[1:]:
        table = gaps(base, rates[q])
        report["gaps"][q] = {str(k): cells for k, cells in table.items()}
        gap, se, k, pos = largest(table)
        print(f"{q}: largest gap {gap:+.3f} +/- {se:.3f} (k={k}, position {pos});",
              " | ".join(" ".join(f"{m:+.3f}" for m, _ in cells) for cells in table.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
