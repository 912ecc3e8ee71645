"""Each projection of a batch-1 (or few-row) decode step at Qwen3.5-0.8B dims, alone, at its real
shape: the achieved read bandwidth of every product form this process's level offers, beside the
mv probe of bench_cpu.py measured in the same process.

    python benchmarks/probes/bench_projections.py --dtype bfloat16 --rows 1
    HYBRID_ENGINE_CPU_ISA=avx2 python benchmarks/probes/bench_projections.py --dtype float32

The level is the process's own (kernels/native/isa.py; lower it with HYBRID_ENGINE_CPU_ISA). Every
weight is held in enough copies to exceed the last-level cache (a decode step reads 1.5-3 GB,
so no weight is cache-hot there), and calls cycle through them. Forms are alternated round by
round so load drift hits all alike; each figure is the median over rounds. `chosen` is the
layout choose_projection picks; `step_ms` weighs each shape by its count per step.
With --threads 1 the clock is the thread's CPU time (time.thread_time), not the wall: on a shared
machine a single-threaded product is then timed for the cycles it ran, not for the time slices
a neighbour took (memory shared with a neighbour still counts).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu, random_checkpoint, ...
from bench_cpu import bandwidth_probe  # noqa: E402

from hybrid_engine.kernels.linear.blocked import block_weight, blocked_linear, native_available  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level, onednn_packs  # noqa: E402
from hybrid_engine.kernels.linear.cpu import choose_projection  # noqa: E402

# (name, out, in, count per step) at Qwen3.5-0.8B dims, the merged weights the layers call
SHAPES = [
    ("gdn in_proj (qkv|z|b|a)", 8224, 1024, 18),
    ("gdn out_proj", 1024, 2048, 18),
    ("attn q|gate|k|v", 5120, 1024, 6),
    ("attn o_proj", 1024, 2048, 6),
    ("mlp gate_up", 7168, 1024, 24),
    ("mlp down", 1024, 3584, 24),
    ("lm_head", 248320, 1024, 1),
]
COLD_BYTES = 400 << 20       # copies of each weight past the 105 MiB L3 of the dev machine


def forms(weight: torch.Tensor) -> dict:
    """name -> callable(x) for each product form of `weight` this level offers."""
    out = {"plain": lambda x, w=weight: F.linear(x, w)}
    if native_available():
        blocked = block_weight(weight)
        out["blocked"] = lambda x, b=blocked: blocked_linear(x, b)
    if onednn_packs(weight.dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        out["onednn"] = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
    out["chosen"] = choose_projection(weight)
    return out


def bench_shape(out_f: int, in_f: int, dtype: torch.dtype, rows: int, rounds: int, clock) -> dict:
    nbytes = out_f * in_f * torch.tensor([], dtype=dtype).element_size()
    copies = max(1, -(-COLD_BYTES // nbytes))
    per_copy = [forms(torch.randn(out_f, in_f).to(dtype)) for _ in range(copies)]
    names = list(per_copy[0])
    x = torch.randn(rows, in_f).to(dtype)
    calls = max(copies, 8)
    times = {n: [] for n in names}
    for name in names:          # warm-up: first calls build kernels and touch pages
        for c in range(copies):
            per_copy[c][name](x)
    for _ in range(rounds):
        for name in names:
            t = clock()
            for i in range(calls):
                per_copy[i % copies][name](x)
            times[name].append((clock() - t) / calls)
    return {n: statistics.median(ts) for n, ts in times.items()} | {"bytes": nbytes,
                                                                     "chosen_type": type(per_copy[0]["chosen"]).__name__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--only", default="", help="comma-separated substrings of shape names")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    load = os.getloadavg()[0]
    probe = bandwidth_probe(gib=1.0, repeats=5)["by_probe_gb_s"]["mv"]
    print(f"level {cpu_level()}, {args.dtype}, rows {args.rows}, threads {args.threads}, "
          f"mv probe {probe:.1f} GB/s (wall), clock {clock.__name__}, load {load:.2f}")
    step = {}
    for name, out_f, in_f, count in SHAPES:
        if args.only and not any(s in name for s in args.only.split(",")):
            continue
        r = bench_shape(out_f, in_f, dtype, args.rows, args.rounds, clock)
        cells = "  ".join(f"{n} {r['bytes'] / r[n] / 1e9:5.1f} GB/s {1e3 * r[n]:7.3f} ms"
                          for n in r if n not in ("bytes", "chosen_type"))
        print(f"{name:26s} {out_f:6d}x{in_f:<5d} x{count:<2d} {cells}  [chosen: {r['chosen_type']}]", flush=True)
        for n in r:
            if n not in ("bytes", "chosen_type"):
                step[n] = step.get(n, 0.0) + count * r[n]
    print("step_ms (projections only): " + "  ".join(f"{n} {1e3 * t:.1f}" for n, t in step.items()))
    print(f"load at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
