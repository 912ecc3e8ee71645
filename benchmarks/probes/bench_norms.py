"""The native RMSNorms (kernels/norm/rms_norm.cpp) against their torch forms (issue 16).

    python benchmarks/probes/bench_norms.py                       # per-call times at 0.8B shapes, 1 and 16 rows
    python benchmarks/probes/bench_norms.py --rows 1,16,512 --threads 2
    python benchmarks/probes/bench_norms.py --model /tmp/hybrid-engine-bench/random-0.8b --dtype bfloat16

Per call: the torch form and the public op (the kernel where it runs) alternated in one process,
medians of --reps blocks, at Qwen3.5-0.8B's shapes (hidden 1024, 16 GDN value heads of 128, 8 q
and 2 kv heads of 256 with 64 rotary dims). With --model: the aten ops one eager batch-1 decode
step dispatches with the kernels and with the torch forms (a count, independent of the machine's
load), and the step's median time, alternating blocks of steps. Quote the load average printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu


def per_call(rows: int, dtype, reps: int, number: int) -> dict[str, tuple[float, float]]:
    import torch

    from hybrid_engine.kernels import rope_cos_sin
    from hybrid_engine.kernels.norm import cpu as native, reference

    g = torch.Generator().manual_seed(0)
    x, h = (3 * torch.randn(2, rows, 1024, generator=g)).to(dtype)
    w = (0.1 * torch.randn(1024, generator=g)).to(dtype)
    projection = torch.randn(rows, 8192, generator=g).to(dtype)
    z = projection[:, 6144:].view(rows, 16, 128)                 # the GDN gate, a column slice
    o = torch.randn(rows, 16, 128, generator=g).to(dtype)
    w_gated = (1 + 0.1 * torch.randn(128, generator=g)).to(dtype)
    q = torch.randn(rows, 8, 512, generator=g).to(dtype).chunk(2, dim=-1)[0]   # q of [q | gate]
    k = torch.randn(rows, 2, 256, generator=g).to(dtype)
    w_q, w_k = (0.1 * torch.randn(2, 256, generator=g)).to(dtype)
    cos, sin = rope_cos_sin(torch.arange(rows) + 40, 64, 1e7, dtype)
    pairs = {
        "rms_norm": (lambda: reference.rms_norm_torch(x, w, 1e-6), lambda: native.rms_norm(x, w, 1e-6)),
        "add_rms_norm": (lambda: reference.add_rms_norm_torch(x, h, w, 1e-6), lambda: native.add_rms_norm(x, h, w, 1e-6)),
        "gated_rms_norm": (lambda: reference.gated_rms_norm_torch(o, z, w_gated, 1e-6),
                           lambda: native.gated_rms_norm(o, z, w_gated, 1e-6)),
        "qk_norm_rope": (lambda: reference.qk_norm_rope_torch(q, k, w_q, w_k, 1e-6, cos, sin),
                         lambda: native.qk_norm_rope(q, k, w_q, w_k, 1e-6, cos, sin)),
    }
    out = {}
    with torch.inference_mode():
        for name, fns in pairs.items():
            times = ([], [])
            for fn in fns:
                fn()
            for _ in range(reps):                               # A, B, A, B, ...
                for i, fn in enumerate(fns):
                    t = time.perf_counter()
                    for _ in range(number):
                        fn()
                    times[i].append((time.perf_counter() - t) / number * 1e6)
            out[name] = tuple(statistics.median(t) for t in times)
    return out


def decode_step(model: str, dtype: str, block: int, rounds: int) -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from bench_cpu import DECODE_PROMPT_LEN, make_engine, prompts
    from hybrid_engine import SamplingParams
    from hybrid_engine.kernels.norm import cpu as native

    engine = make_engine(model, dtype, 1)
    vocab = engine.model_config.vocab_size
    engine.add_request(prompts(vocab, 1, DECODE_PROMPT_LEN, 0)[0],
                       SamplingParams(temperature=0.0, max_tokens=8 + 2 * rounds * (block + 1), ignore_eos=True))
    engine.step()
    routes = {"native": (native.can_run_native, native.can_run_qk_norm_rope),
              "torch forms": (lambda *a: False, lambda *a: False)}

    def use(route):
        native.can_run_native, native.can_run_qk_norm_rope = routes[route]

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    for route in routes:
        use(route)
        engine.step()
        with CountOps() as counter:
            engine.step()
        top = ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(6))
        print(f"{route:12s} aten ops per decode step: {sum(counter.ops.values())} ({top})")
    times = {route: [] for route in routes}
    for _ in range(rounds):
        for route in routes:
            use(route)
            engine.step()                                       # the switch's first step is left out
            for _ in range(block):
                t = time.perf_counter()
                engine.step()
                times[route].append(time.perf_counter() - t)
    use("native")
    native, plain = (statistics.median(times[r]) * 1e3 for r in routes)
    print(f"step median: native {native:.2f} ms, torch forms {plain:.2f} ms ({plain / native:.3f}x; "
          f"{rounds} rounds of {block} steps, alternated)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--number", type=int, default=300)
    ap.add_argument("--model", help="a checkpoint folder: also count and time its eager decode steps")
    ap.add_argument("--dtype", default="bfloat16", help="the --model run's dtype")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    import torch

    from hybrid_engine.kernels.native.isa import cpu_level

    torch.set_num_threads(args.threads)
    print(f"level {cpu_level()}, {args.threads} threads, load average {os.getloadavg()}")
    for dtype_name in args.dtypes.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            res = per_call(rows, getattr(torch, dtype_name), args.reps, max(1, args.number // rows))
            print(f"{dtype_name:8s} rows {rows:4d}: " + "  ".join(
                f"{name} {a:.1f} -> {b:.1f} us ({a / b:.1f}x)" for name, (a, b) in res.items()))
    if args.model:
        decode_step(args.model, args.dtype, args.block, args.rounds)
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
    main()
