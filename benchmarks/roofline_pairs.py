"""Batch-1 decode's share of the memory roofline, each timed block divided by bandwidth probes
taken just before and just after it. Our engine stays loaded in a child process
(pair_llamacpp.Ours: benchmarks/ab_decode_child.py) while this process alternates bench_cpu.bandwidth_probe and a
timed block of the child's decode steps, PAIRS times. The host's read rate drifts (17-30 GB/s
within minutes on a Zen 3 VM), so one probe for a whole table says little about a row taken a
minute later.

    python benchmarks/roofline_pairs.py CHECKPOINT DTYPE [--steps 16] [--pairs 8] [--threads N] [--engine compiled] [--json out.json]

The roofline: bench_llamacpp.roofline (every weight once, the GDN states and the KV of the
mean context per step) at the mean of the two probes around the block; CHECKPOINT must have
the 0.8B dims (random_checkpoint.QWEN35_08B_CONFIG). A quantized DTYPE (q8_0, q4_0: ours
quantized at load at those bits, bf16 activations, as pair_llamacpp.py runs it) counts the
weight bytes the quantized model holds (bench_cpu.quantized_weight_bytes, from one load of it
here before the pairs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_cpu import bandwidth_probe, make_engine, quantized_weight_bytes  # noqa: E402
from bench_llamacpp import (GENERATE, QUANTIZED, QWEN35_08B_CONFIG, cpu_record, quantized_weights_read,  # noqa: E402
                            roofline)
from pair_llamacpp import Ours  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("dtype", choices=["float32", "bfloat16", *QUANTIZED])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed block")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--gib", type=float, default=1.0, help="probe tensor size")
    ap.add_argument("--engine", choices=["ours", "compiled"], default="ours", help="eager or torch.compile'd steps")
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype, weights = args.dtype, None
    if dtype in QUANTIZED:
        pair = QUANTIZED[dtype]
        engine = make_engine(args.checkpoint, "bfloat16", 1, quantization=pair.method,
                             quantization_group_size=pair.group_size)
        weights = quantized_weights_read(QWEN35_08B_CONFIG, "bfloat16", quantized_weight_bytes(engine.model))
        del engine
        dtype = "bfloat16"                      # the state and KV: the activations' dtype
    ours = Ours(Path(args.checkpoint), args.dtype, args.steps, args.engine, "native", args.threads)
    rows, before = [], bandwidth_probe(args.gib, repeats=3)["gb_s"]
    for _ in range(args.pairs):
        tok_s = ours.block()
        after = bandwidth_probe(args.gib, repeats=3)["gb_s"]
        roof = roofline(dtype, GENERATE, (before + after) / 2, weights=weights)["tok_s"]
        rows.append({"tok_s": tok_s, "probe_before_gb_s": before, "probe_after_gb_s": after,
                     "roofline_tok_s": roof, "share": tok_s / roof})
        print(f"{tok_s:6.2f} tok/s, probes {before:5.1f} / {after:5.1f} GB/s, roofline {roof:5.2f} tok/s: "
              f"{100 * tok_s / roof:5.1f}%", flush=True)
        before = after
    ours.close()
    shares = sorted(r["share"] for r in rows)
    print(f"{args.dtype}: median share {100 * statistics.median(shares):.1f}% "
          f"(range {100 * shares[0]:.1f}-{100 * shares[-1]:.1f}%), {len(rows)} blocks of {args.steps} steps")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), "cpu": cpu_record(), "threads": args.threads,
            "engine": args.engine, "dtype": args.dtype, "weight_bytes_per_step": weights, "median_share": statistics.median(shares), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
