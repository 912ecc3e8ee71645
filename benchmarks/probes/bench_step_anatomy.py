"""Where a quantized batch-1 decode step's time goes (issue 39's roofline point): the step's wall
against the time inside its quantized products (each kind: the plain projections, the GDN
in_proj with its float tail, the MLPs, the lm_head with its rescoring) and inside the GDN decode
op, every call timed from Python around the op; and, in a second engine whose products return
uninitialised outputs at once, the step without them (`fixed_ms`: everything but the products'
arithmetic and reads). Blocks of steps alternate with bandwidth probes, as roofline_pairs.py.

    python benchmarks/probes/bench_step_anatomy.py CHECKPOINT [--quantization int4] [--steps 32] [--blocks 4] [--json F]

What it showed (benchmarks/RESULTS.md, issue 39, session 37): the products read at 80-85% of the
probe's bandwidth, and the rest of the step (small ops, Python) is larger with the products than
without them.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # benchmarks/: bench_cpu
from bench_cpu import bandwidth_probe, make_engine  # noqa: E402

from hybrid_engine import SamplingParams  # noqa: E402
from hybrid_engine.kernels.gdn import decode_cpu  # noqa: E402
from hybrid_engine.kernels.linear import quantized  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402

from bench_rescoring import write_report  # noqa: E402  (this folder: the script's own, first on sys.path)

Method = quantized.QuantizedLinearMethod


def timed(spent: dict, kind: str, call):
    def run(*args):
        start = time.perf_counter()
        out = call(*args)
        spent[kind] += time.perf_counter() - start
        return out
    return run


def instrument(spent: dict) -> None:
    """Every quantized product, MLP and GDN decode op adds its time to spent[kind]; a method
    marked `bare` (the second engine's) gives its MLPs' outputs at once instead."""
    product, swiglu = Method.product, Method.apply_swiglu

    def timed_product(self, layer):
        kind = ("lm_head" if layer.row_table is not None or layer.out_features > 100_000
                else "in_proj (+ float tail)" if layer.float_tail is not None else "projections")
        return timed(spent, kind, product(self, layer))

    def mlp(self, gate_up, down, x, act):
        if getattr(self, "bare", False):
            return empty(x, down.out_features)
        return timed(spent, "mlp", swiglu)(self, gate_up, down, x, act)
    Method.product, Method.apply_swiglu = timed_product, mlp
    decode_cpu.gdn_decode_op = timed(spent, "gdn decode op", decode_cpu.gdn_decode_op)


def empty(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.empty(*x.shape[:-1], rows, dtype=x.dtype)


def bare_engine(args):
    """An engine whose quantized products return uninitialised outputs of their shapes at once."""
    timed_product = Method.product
    Method.product = lambda self, layer: lambda x: empty(x, layer.out_features)
    try:
        eng = engine(args)
    finally:
        Method.product = timed_product
    for module in eng.model.modules():
        if isinstance(getattr(module, "method", None), Method):
            module.method.bare = True
    return eng


def engine(args):
    eng = make_engine(args.checkpoint, "bfloat16", 1, quantization=args.quantization)
    tokens = 8 + args.blocks * args.steps + 1                # the request outlives every block
    eng.add_request(list(range(1, 33)), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    for _ in range(8):
        eng.step()
    return eng


def block_ms(eng, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--quantization", default="int4", choices=["int8", "int4"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    spent = collections.defaultdict(float)
    instrument(spent)
    timed_engine, bare = engine(args), bare_engine(args)
    rows = []
    for _ in range(args.blocks):
        gb_s = bandwidth_probe(1.0, repeats=3)["gb_s"]
        spent.clear()
        wall = block_ms(timed_engine, args.steps)
        parts = {kind: t / args.steps * 1e3 for kind, t in sorted(spent.items())}
        fixed = block_ms(bare, args.steps)
        rows.append({"probe_gb_s": gb_s, "step_ms": wall, "parts_ms": parts, "fixed_ms": fixed})
        rest = wall - sum(parts.values())
        print(f"probe {gb_s:5.1f} GB/s  step {wall:6.2f} ms  " + "  ".join(f"{k} {v:.2f}" for k, v in parts.items())
              + f"  rest {rest:.2f}  | without products {fixed:.2f} ms", flush=True)
    assert timed_engine.has_unfinished_requests() and bare.has_unfinished_requests()
    print(f"medians: step {statistics.median(r['step_ms'] for r in rows):.2f} ms, "
          f"without products {statistics.median(r['fixed_ms'] for r in rows):.2f} ms (level {cpu_level()})")
    if args.json:
        write_report(args.json, args.threads, rows, quantization=args.quantization, steps=args.steps)


if __name__ == "__main__":
    main()
