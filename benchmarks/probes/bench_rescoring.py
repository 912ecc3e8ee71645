"""The rescoring of a tied int4 lm_head (kernels/linear/quantized.py `QuantizedLinearMethod._rescore`)
per call: its torch form (`rescore_top_reference`: topk, the rows split from their blocks, a
float64 dot, scatter) against the native op (quant_rows.cpp `rescore_top`: one pass over the
logits, each row read from its block), at the default model's shape and at 0.8B's; and a tied
embedding's lookup of one id (`unpack(rows=...)` against `quant_rows`). Medians of timed calls
on random weights, int8 tables in groups of 32.

    python benchmarks/probes/bench_rescoring.py [--threads 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hybrid_engine.kernels.linear.quantized import RESCORED_ROWS, quantize_packed, rescore_top_reference, unpack
from hybrid_engine.kernels.native.isa import cpu_level
from hybrid_engine.kernels.native.ops import native_ops

SHAPES = {"default model": (3072, 192), "0.8B dims": (248320, 1024)}    # lm_head rows, hidden


def median_us(call, repeats: int) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def probe_args(doc: str) -> argparse.Namespace:
    """--threads (set for torch) and --json of a probe that needs the native kernels."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if native_ops() is None:
        raise SystemExit("no native kernels at this level")
    return args


def main() -> None:
    args = probe_args(__doc__)
    ops = native_ops()
    g = torch.Generator().manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        table = quantize_packed(torch.randn(n, k, generator=g) * 0.02, 8, 32)
        for m in (1, 3, 5):
            x = torch.randn(m, k, generator=g).bfloat16()
            y = torch.randn(m, n, generator=g).bfloat16()
            copy = median_us(lambda: y.clone(), 200)          # the native op writes in place: a copy each call
            torch_us = median_us(lambda: rescore_top_reference(x, y, table, 8, 32, RESCORED_ROWS), 50)
            native_us = median_us(lambda: ops.rescore_top.default(x, y.clone(), table, None, 8, 32, RESCORED_ROWS),
                                  200) - copy
            rows.append({"shape": name, "rows": m, "torch_us": torch_us, "native_us": native_us})
            print(f"{name:14s} {m} rows: rescoring torch {torch_us:8.1f} us, native {native_us:6.1f} us")
        ids = torch.tensor([n // 3])
        lookup = {"torch_us": median_us(lambda: unpack(table, 8, 32, rows=ids), 200),
                  "native_us": median_us(lambda: ops.quant_rows.default(table, None, ids, 8, 32, k), 200)}
        rows.append({"shape": name, "lookup_of_one_id": lookup})
        print(f"{name:14s} one lookup: unpack {lookup['torch_us']:6.1f} us, quant_rows {lookup['native_us']:6.1f} us")
    if args.json:
        write_report(args.json, args.threads, rows)


def write_report(path: str, threads: int, rows: list[dict], **fields) -> None:
    """A probe's JSON: the date, the level, the threads, its own fields, its rows."""
    with open(path, "w") as f:
        json.dump({"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpu_level": cpu_level(),
                   "threads": threads, **fields, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
