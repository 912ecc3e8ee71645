"""The GDN conv update of decode and verify steps: the torch form (kernels/conv/reference.py
`causal_conv1d_update_torch`, ~12 ops) against the native kernel (kernels/conv/causal_conv1d_update.cpp,
one call), in the same process on the same pool.

    python benchmarks/probes/bench_conv.py                        # default-model and 0.8B widths, batch 1/16, q 1/3
    python benchmarks/probes/bench_conv.py --dims 6144 --batches 1 --q 1 --dtypes bfloat16
    python benchmarks/probes/bench_conv.py --ops                  # ops per eager decode step, default model

Layer mode (default): per case one layer's call on a pool of 4 x batch x q slots (each row
reading its slot, token 0 written back there, later tokens to other slots); the median of
--runs calls of each form, interleaved (old, new, old, new ...) so a busy neighbour slows both
alike. Prints us per call and the ratio old / new.

--ops: the operators one eager decode step of the default model runs (torch.profiler events:
aten::* and hybrid_engine_cpu::*, nested ones included) with the kernel and with it turned off
(this script patches kernels/conv/reference.py's `can_run_native`), mean over --steps
steps. Counts do not move with the machine's load. On a shared machine quote the load
average printed too.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu, random_checkpoint, ...

from hybrid_engine.kernels.conv.reference import causal_conv1d_update_torch  # noqa: E402
from hybrid_engine.kernels.conv import cpu as native  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402
from hybrid_engine.kernels.slot_pool import DecodeRows  # noqa: E402

K = 4


def case(batch: int, dim: int, q_len: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    slots = 4 * batch * q_len
    x = torch.randn(batch, q_len, dim, generator=g).to(dtype)
    weight = torch.randn(dim, K, generator=g).to(dtype)
    pool = torch.randn(slots, dim, K - 1, generator=g).to(dtype)
    perm = torch.randperm(slots, generator=g)
    read = perm[:batch]
    write = torch.cat([read[:, None], perm[batch:batch * q_len].view(batch, q_len - 1)], 1)
    return x, weight, pool, read, write, DecodeRows.of_tensors(read, write)


def layer(args) -> None:
    print(f"{'dtype':9} {'dim':>5} {'batch':>5} {'q':>2} {'torch us':>9} {'native us':>10} {'ratio':>6}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for dim in args.dims:
            for batch in args.batches:
                for q_len in args.q:
                    x, weight, pool, read, write, rows = case(batch, dim, q_len, dtype)

                    def old():
                        causal_conv1d_update_torch(x, weight, pool, read, write, rows)

                    def new():
                        native.conv_update_op(x, weight, pool, read, write)

                    old(), new()                          # warm-up: the kernel's first call loads it
                    times = {old: [], new: []}
                    for _ in range(args.runs):
                        for fn in (old, new):
                            t = time.perf_counter()
                            fn()
                            times[fn].append(time.perf_counter() - t)
                    a, b = (statistics.median(times[fn]) * 1e6 for fn in (old, new))
                    print(f"{dtype_name:9} {dim:5} {batch:5} {q_len:2} {a:9.1f} {b:10.1f} {a / b:6.2f}", flush=True)


def ops_per_step(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench_cpu import DECODE_PROMPT_LEN, make_engine, prompts
    from hybrid_engine import SamplingParams
    from hybrid_engine.default_model import default_model_path

    kernel_check = native.can_run_native
    print(f"default model, float32, eager decode, operators per step, mean over {args.steps} steps")
    for batch in args.batches:
        engine = make_engine(str(default_model_path()), "float32", batch)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=4 * args.steps + 8, ignore_eos=True)
        for p in prompts(vocab, batch, DECODE_PROMPT_LEN, 0):
            engine.add_request(p, params)
        for _ in range(4):                                # the prefill and the first decodes
            engine.step()
        counts = {}
        try:
            for on in (True, False):
                native.can_run_native = kernel_check if on else (lambda *a: False)
                engine.step()                             # one unprofiled step in the new form
                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    for _ in range(args.steps):
                        engine.step()
                names = collections.Counter()
                for event in prof.events():
                    if event.name.startswith(("aten::", "hybrid_engine_cpu::")):
                        names[event.name] += 1
                counts[on] = names
        finally:
            native.can_run_native = kernel_check
        on, off = (sum(counts[k].values()) / args.steps for k in (True, False))
        print(f"batch {batch:2}: torch form {off:7.1f} ops/step, native {on:7.1f} ops/step "
              f"({off - on:.1f} fewer, {(off - on) / off:.1%})")
        for name in sorted(set(counts[True]) | set(counts[False]),
                           key=lambda n: counts[True][n] - counts[False][n])[:args.top]:
            delta = (counts[True][name] - counts[False][name]) / args.steps
            if delta:
                print(f"    {delta:+7.2f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dims", type=int, nargs="+", default=[256, 6144],
                    help="conv channels (256: the default model, 6144: Qwen3.5-0.8B)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--q", type=int, nargs="+", default=[1, 3], help="new tokens per row (1: decode)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--ops", action="store_true", help="operators per decode step (see above)")
    ap.add_argument("--steps", type=int, default=8, help="--ops: profiled steps per form")
    ap.add_argument("--top", type=int, default=12, help="--ops: list the ops that changed most")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.native_available():
        sys.exit(f"no native kernel at level {cpu_level()}")
    print(f"level {cpu_level()}, threads {args.threads}, load average {os.getloadavg()[0]:.2f}")
    if args.ops:
        ops_per_step(args)
    else:
        print(f"median of {args.runs} interleaved calls")
        layer(args)


if __name__ == "__main__":
    main()
