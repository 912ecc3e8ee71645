"""One attention layer's decode at Qwen3.5-0.8B head dims: the torch form (gather the cached K/V
out of the blocks into a new tensor, then sdpa) against the native kernel that reads them in
place (kernels/attention/paged_attention.cpp), in the same process on the same cache.

    python benchmarks/probes/bench_attention.py                       # contexts 512/2048/8192, batch 1/16
    python benchmarks/probes/bench_attention.py --dtypes bfloat16 --contexts 2048 --batches 1 --q 1 3
    python benchmarks/probes/bench_attention.py --decode /tmp/hybrid-engine-bench/random-0.8b --contexts 512 2048

Layer mode (default): each case a cache of shuffled 16-slot blocks holding `context` tokens
per sequence (NaN in the slots past them), a step of `q` new tokens per sequence; the median
of --runs calls of each form, interleaved (old, new, old, new ...) so a busy neighbour slows
both alike. Prints ms per layer call and the ratio old / new.

--decode CHECKPOINT: batch-1 eager decode of the engine on that checkpoint (bench_cpu.py's
random 0.8B one) after a prompt of `context` tokens, in one engine: rounds of --steps decode
steps with the in-place kernel, then with it turned off (this script patches
kernels/attention/cpu.py's `can_run_native`), alternating; median step time of each. On a shared
machine quote the load average printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu, random_checkpoint, ...
from random_checkpoint import QWEN35_08B_CONFIG  # noqa: E402

from hybrid_engine.kernels.attention import attend_paged, attention_layout  # noqa: E402
from hybrid_engine.kernels.attention import cpu as native  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402

BLOCK = 16


def case(batch: int, context: int, q_len: int, dtype: torch.dtype):
    nh, nkv, hd = (QWEN35_08B_CONFIG[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim"))
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    num_blocks = batch * per_seq + 2
    cache = torch.full((num_blocks, 2, BLOCK, nkv, hd), float("nan"), dtype=dtype)
    ids = torch.randperm(num_blocks, generator=g)[:batch * per_seq].view(batch, per_seq)
    for n in range(batch):
        pos = torch.arange(context)
        cache[ids[n, pos // BLOCK], :, pos % BLOCK] = torch.randn(context, 2, nkv, hd, generator=g).to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch * q_len, nh, hd, generator=g).to(dtype)
    layout = attention_layout(ids, lens, [q_len] * batch, BLOCK, slots_valid=True)
    return q, cache, ids, lens, layout, hd ** -0.5


def timed(fn, runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def decode(folder: str, dtype: str, context: int, steps: int, rounds: int) -> tuple[float, float]:
    """-> median batch-1 decode step ms (in place, gather + sdpa) after a `context`-token prompt."""
    from hybrid_engine import SamplingParams
    from hybrid_engine.config import EngineConfig
    from hybrid_engine.engine import LLMEngine
    # stepped on this thread: no LLM loop thread beside it (hybrid_engine/engine_loop.py)
    engine = LLMEngine(EngineConfig(model=folder, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=max(2048, context),
                                    max_model_len=context + 2 * steps * rounds + 8))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, QWEN35_08B_CONFIG["vocab_size"], (context,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=2 * steps * rounds + 2, ignore_eos=True))
    engine.step()                                              # the prefill
    engine.step()
    kernel_check = native.can_run_native
    times = {True: [], False: []}
    try:
        for _ in range(rounds):
            for in_place in (True, False):
                native.can_run_native = kernel_check if in_place else (lambda *a: False)
                for _ in range(steps):
                    t = time.perf_counter()
                    engine.step()
                    times[in_place].append(time.perf_counter() - t)
    finally:
        native.can_run_native = kernel_check
    return statistics.median(times[True]) * 1e3, statistics.median(times[False]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--q", type=int, nargs="+", default=[1], help="new tokens per sequence (1: decode)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--decode", metavar="CHECKPOINT", help="engine decode mode (see above)")
    ap.add_argument("--steps", type=int, default=4, help="--decode: steps per round")
    ap.add_argument("--rounds", type=int, default=3, help="--decode: rounds of each form")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not native.native_available():
        sys.exit(f"no native kernel at level {cpu_level()}")
    print(f"level {cpu_level()}, threads {args.threads}, load average {os.getloadavg()[0]:.2f}, "
          f"median of {args.runs} interleaved calls")
    if args.decode:
        print(f"{'dtype':9} {'ctx':>5} {'in place step ms':>17} {'gather+sdpa step ms':>20} {'ratio':>6}")
        for dtype_name in args.dtypes:
            for context in args.contexts:
                new, old = decode(args.decode, dtype_name, context, args.steps, args.rounds)
                print(f"{dtype_name:9} {context:5} {new:17.1f} {old:20.1f} {old / new:6.2f}", flush=True)
        return
    print(f"{'dtype':9} {'batch':>5} {'ctx':>5} {'q':>2} {'gather+sdpa ms':>15} {'in place ms':>12} {'ratio':>6}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for batch in args.batches:
            for context in args.contexts:
                for q_len in args.q:
                    q, cache, table, lens, layout, scale = case(batch, context, q_len, dtype)
                    nh, hd = q.shape[1:]

                    def old():
                        attend_paged(q.view(batch, q_len, nh, hd), cache, layout.keys, scale)

                    def new():
                        native.paged_attention_op(q, cache, table, lens, scale).to(q.dtype)

                    old(), new()                          # warm-up: the kernel's first call loads it
                    t_old, t_new = [], []
                    for _ in range(args.runs):
                        t_old += timed(old, 1)
                        t_new += timed(new, 1)
                    a, b = statistics.median(t_old) * 1e3, statistics.median(t_new) * 1e3
                    print(f"{dtype_name:9} {batch:5} {context:5} {q_len:2} {a:15.3f} {b:12.3f} {a / b:6.2f}",
                          flush=True)


if __name__ == "__main__":
    main()
