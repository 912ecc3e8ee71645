"""Memory after load, with and without MTP speculation (issue 15): resident set size of a
fresh process that has built an LLM, the cache pools' bytes, and the model's weight bytes
(quantized weights' packed values, scales and float tails counted apart: issue 39's bound is
RSS <= 1.1 x quantized bytes + cache + 300 MB).

    python benchmarks/probes/memory_after_load.py [--model FOLDER] [--dtype float32] [--k 4]
        [--quantization int4] [--cache-memory-bytes N]

Each configuration runs in its own process, so one's pages never count towards the other's
RSS. Memory figures, unlike timings, mean something on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def measure(model: str | None, dtype: str, k: int, quantization: str | None = None,
            cache_memory_bytes: int | None = None) -> dict:
    """In this process: build the LLM, then read VmRSS (the kernel's count, pages really held)."""
    import torch

    from hybrid_engine import LLM

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    llm = LLM(model=model, dtype=dtype, speculative_config=spec, quantization=quantization,
              cache_memory_bytes=cache_memory_bytes)
    engine = llm.engine
    cache = engine.cache
    pools = cache.pools                     # with prefix caching's GDN checkpoints (on by default)
    cache_bytes = sum(t.numel() * t.element_size()
                      for t in (pools.kv_caches + pools.conv_states + pools.recurrent_states
                                + pools.checkpoint_conv_states + pools.checkpoint_recurrent_states
                                + [pools.checkpoint_hidden]))
    weights = [t for t in list(engine.model.parameters()) + list(engine.model.buffers()) if not t.is_meta]
    weight_bytes = sum(t.numel() * t.element_size() for t in weights if not t.is_mkldnn)
    quantized = [getattr(m, name) for m in engine.model.modules()
                 for name in ("qweight", "qscales", "qzeros", "float_tail")
                 if isinstance(getattr(m, name, None), torch.Tensor)]
    quantized_bytes = sum(t.numel() * t.element_size() for t in quantized)
    with open("/proc/self/status") as f:
        rss_kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"k": k, "rss_mib": rss_kib / 1024, "cache_mib": cache_bytes / 2**20,
            "checkpoints": cache.prefix_store.checkpoints.size,
            "kv_pools": len(pools.kv_caches), "mtp_module": engine.model.mtp is not None,
            "weight_mib": weight_bytes / 2**20, "quantized_mib": quantized_bytes / 2**20,
            "bound_mib": 1.1 * quantized_bytes / 2**20 + cache_bytes / 2**20 + 300 * 1e6 / 2**20,
            "quantization": quantization, "torch": torch.__version__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder; default: the embedded default model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the speculative run")
    ap.add_argument("--quantization", default=None, choices=("int8", "int4"))
    ap.add_argument("--cache-memory-bytes", type=int, default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)   # child process: this k only
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.model, args.dtype, args.one, args.quantization, args.cache_memory_bytes)))
        return
    rows = []
    for k in (0, args.k):
        cmd = [sys.executable, __file__, "--dtype", args.dtype, "--one", str(k)]
        if args.model:
            cmd += ["--model", args.model]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.cache_memory_bytes:
            cmd += ["--cache-memory-bytes", str(args.cache_memory_bytes)]
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]))
    print(f"{'speculation':>12} {'RSS MiB':>9} {'cache MiB':>10} {'KV pools':>9} {'MTP module':>11} {'weights MiB':>12} "
          f"{'quantized MiB':>14} {'bound MiB':>10}")
    for r in rows:
        print(f"{('k=' + str(r['k'])) if r['k'] else 'off':>12} {r['rss_mib']:9.1f} {r['cache_mib']:10.1f} "
              f"{r['kv_pools']:9d} {str(r['mtp_module']):>11} {r['weight_mib']:12.1f} {r['quantized_mib']:14.1f} "
              f"{r['bound_mib']:10.1f}")


if __name__ == "__main__":
    main()
