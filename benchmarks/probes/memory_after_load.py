"""Memory after load, with and without MTP speculation (issue 15): resident set size of a
fresh process that has built an LLM, the cache pools' bytes, and the model's weight bytes
(quantized weights' packed values, scales and float tails counted apart: issue 39's bound is
RSS <= 1.1 x the quantized model's weight bytes + cache + 300 MB, where the weight bytes are
the quantized tensors and those the scheme keeps float: norms, conv taps, the MTP head's fc,
as a GGUF file's size counts its F32 tensors too). Also loading's peak: the kernel's high-water
mark of RSS (VmHWM: counts the checkpoint's file-backed mmap pages, which the kernel may
reclaim) and the peak of anonymous memory alone (RssAnon, sampled every 2 ms while the LLM is
built: the memory loading really needs), and both after loading.

    python benchmarks/probes/memory_after_load.py [--model FOLDER] [--dtype float32] [--k 4]
        [--quantization int4] [--cache-memory-bytes N] [--json FILE]

Each configuration runs in its own process, so one's pages never count towards the other's
RSS. Memory figures, unlike timings, mean something on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time


def _status_kib(*fields: str) -> dict[str, int]:
    """/proc/self/status lines -> KiB (the kernel's counts of pages really held)."""
    with open("/proc/self/status") as f:
        found = dict(line.split(":", 1) for line in f)
    return {field: int(found[field].split()[0]) for field in fields}


class AnonPeak:
    """The largest RssAnon seen while running (sampled in a thread: torch's ops release the GIL,
    so the samples land inside long casts and quantizations too)."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.peak_kib, self._stop = every_s, 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, _status_kib("RssAnon")["RssAnon"])
            time.sleep(self.every_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("RssAnon")["RssAnon"])


def measure(model: str | None, dtype: str, k: int, quantization: str | None = None,
            cache_memory_bytes: int | None = None) -> dict:
    """In this process: build the LLM, then read VmRSS (the kernel's count, pages really held)."""
    import torch

    from hybrid_engine import LLM

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    with AnonPeak() as anon:
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
    weights += [t for m in engine.model.modules() for t in _layout_tensors(getattr(m, "layout", None))]
    weights = {t.data_ptr(): t for t in weights if not t.is_mkldnn}.values()     # (oneDNN's packed: unsized)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    quantized = [getattr(m, name) for m in engine.model.modules()
                 for name in ("qweight", "qzeros", "float_tail")
                 if isinstance(getattr(m, name, None), torch.Tensor)]
    # a tied lm_head's lookup rows
    quantized += [m.row_table for m in engine.model.modules() if getattr(m, "row_table", None) is not None]
    quantized_bytes = sum(t.numel() * t.element_size() for t in quantized)
    status = _status_kib("VmRSS", "VmHWM", "RssAnon", "RssFile")
    return {"k": k, "rss_mib": status["VmRSS"] / 1024, "anon_mib": status["RssAnon"] / 1024,
            "file_mib": status["RssFile"] / 1024, "peak_rss_mib": status["VmHWM"] / 1024,
            "peak_anon_mib": anon.peak_kib / 1024, "cache_mib": cache_bytes / 2**20,
            "checkpoints": cache.prefix_store.checkpoints.size,
            "kv_pools": len(pools.kv_caches), "mtp_module": engine.model.mtp is not None,
            "weight_mib": weight_bytes / 2**20, "quantized_mib": quantized_bytes / 2**20,
            "bound_mib": 1.1 * (quantized_bytes + weight_bytes) / 2**20 + cache_bytes / 2**20 + 300 * 1e6 / 2**20,
            "quantization": quantization, "torch": torch.__version__}


def _layout_tensors(layout) -> list:
    """The tensors a float projection's layout holds in place of its weight (kernels/linear/cpu.py:
    a blocked copy, or the few- and many-row layouts of a split)."""
    import torch
    if layout is None:
        return []
    found = []
    for value in vars(layout).values():
        if isinstance(value, torch.Tensor) and not value.is_meta:
            found.append(value)
        elif hasattr(value, "__dict__") and not isinstance(value, type):
            found += _layout_tensors(value)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder; default: the embedded default model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens of the speculative run")
    ap.add_argument("--quantization", default=None, choices=("int8", "int4"))
    ap.add_argument("--cache-memory-bytes", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
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
        rows.append(json.loads(subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout.splitlines()[-1]))
    print(f"{'speculation':>12} {'RSS MiB':>9} {'anon MiB':>9} {'peak RSS':>9} {'peak anon':>10} {'cache MiB':>10} "
          f"{'KV pools':>9} {'MTP module':>11} {'weights MiB':>12} {'quantized MiB':>14} {'bound MiB':>10}")
    for r in rows:
        print(f"{('k=' + str(r['k'])) if r['k'] else 'off':>12} {r['rss_mib']:9.1f} {r['anon_mib']:9.1f} "
              f"{r['peak_rss_mib']:9.1f} {r['peak_anon_mib']:10.1f} {r['cache_mib']:10.1f} "
              f"{r['kv_pools']:9d} {str(r['mtp_module']):>11} {r['weight_mib']:12.1f} {r['quantized_mib']:14.1f} "
              f"{r['bound_mib']:10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
