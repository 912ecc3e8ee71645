"""Small bf16 projections (under kernels/linear/cpu.py's BLOCKED_MIN_BYTES: the default model's,
the MTP head's fc) per call, in each form this process's level offers: the blocked kernel (or
its widening form where the level has no bf16 dot product), oneDNN's packed product where it
packs bf16, and torch's own bf16 product; at the row counts of decode, MTP verify, a batch and a
prefill. Medians of timed calls on random weights, one weight (cache-hot: at these sizes a call's
fixed cost is what differs).

    python benchmarks/probes/bench_small_bf16.py [--threads 2] [--json FILE]
    HYBRID_ENGINE_CPU_ISA=avx2 python benchmarks/probes/bench_small_bf16.py
"""

from __future__ import annotations

import torch

from hybrid_engine.kernels.linear.cpu import BlockedProjection, OneDNNProjection, WideningProjection
from hybrid_engine.kernels.linear.reference import plain_linear
from hybrid_engine.kernels.native.isa import at_least, onednn_packs

from bench_rescoring import median_us, probe_args, write_report      # (this folder: the script's own, first on sys.path)

SHAPES = [(192, 384), (1728, 192), (192, 864), (3072, 192)]     # mtp.fc, gate_up, down, lm_head
ROWS = [1, 3, 5, 64, 512]


def main() -> None:
    args = probe_args(__doc__)
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=g).bfloat16()
        forms = {"kernel": (BlockedProjection if at_least("avx512_bf16") else WideningProjection)(w),
                 "torch": lambda x, w=w: plain_linear(x, w)}
        if onednn_packs(torch.bfloat16):
            forms["onednn"] = OneDNNProjection(w)
        for m in ROWS:
            x = torch.randn(m, k, generator=g).bfloat16()
            row = {"shape": [n, k], "rows": m, **{name: median_us(lambda f=f: f(x), 300) for name, f in forms.items()}}
            rows.append(row)
            print(f"[{n}, {k}] {m:3d} rows: " + ", ".join(f"{name} {row[name]:7.1f} us" for name in forms))
    if args.json:
        write_report(args.json, args.threads, rows)


if __name__ == "__main__":
    main()
