"""The fused GDN decode op (kernels/gdn/decode_cpu.py) against the composition the layer ran
before it (kernels/gdn/decode.py `gdn_decode_torch`: the conv update op, the gates, the q/k norm and
the gdn_recurrent op), on one engine in one process: eager b1 greedy decode steps, the two forms
alternated block by block (the order flipped every round) so load drift hits both alike.

    python benchmarks/probes/bench_gdn_decode.py --model /tmp/hybrid-engine-bench/random-0.8b --dtype bfloat16
    python benchmarks/probes/bench_gdn_decode.py --model default --dtype float32 --threads 1

Prints the top-level ops per step (torch.profiler, load-independent) and the median step time of
each form with their ratio. With --threads 1 the clock is the thread's CPU time (a neighbour's
time slices do not count); otherwise the wall.
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
from bench_cpu import DECODE_PROMPT_LEN, MAX_MODEL_LEN, make_engine, prompts  # noqa: E402

from hybrid_engine import SamplingParams  # noqa: E402
from hybrid_engine.default_model import default_model_path  # noqa: E402
from hybrid_engine.kernels.gdn import decode_cpu as native  # noqa: E402


def top_level_ops(engine, steps: int) -> collections.Counter:
    with torch.profiler.profile() as prof:
        for _ in range(steps):
            engine.step()
    return collections.Counter(e.name for e in prof.events() if e.cpu_parent is None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="default", help="a checkpoint folder, or `default`")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="timed steps per block")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    folder = str(default_model_path()) if args.model == "default" else args.model
    engine = make_engine(folder, args.dtype, 1)
    new_tokens = 2 * args.rounds * (args.steps + 1) + 8 + 2 * 4
    assert DECODE_PROMPT_LEN + new_tokens <= MAX_MODEL_LEN, "fewer rounds or steps: the request would end"
    engine.add_request(prompts(1000, 1, DECODE_PROMPT_LEN, 0)[0],
                       SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
    engine.step()                                   # the prefill
    can_run = native.can_run_native
    forms = {"composition": lambda *a: False, "fused": can_run}
    try:
        for name, check in forms.items():
            native.can_run_native = check
            engine.step()
            ops = top_level_ops(engine, 4)
            print(f"{name:12s} top-level ops/step {sum(ops.values()) / 4:.0f}")
        times = {name: [] for name in forms}
        for r in range(args.rounds):
            for name in (list(forms) if r % 2 == 0 else list(forms)[::-1]):
                native.can_run_native = forms[name]
                engine.step()                       # settle
                t = clock()
                for _ in range(args.steps):
                    engine.step()
                times[name].append((clock() - t) / args.steps)
    finally:
        native.can_run_native = can_run
    a, b = (statistics.median(times[n]) for n in forms)
    load = os.getloadavg()[0]
    print(f"{Path(folder).name} {args.dtype}, {args.threads} threads, clock {clock.__name__}, load {load:.2f}: "
          f"composition {a * 1e3:.2f} ms/step, fused {b * 1e3:.2f} ms/step, composition / fused {a / b:.3f}")


if __name__ == "__main__":
    main()
