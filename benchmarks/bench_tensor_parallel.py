"""Tensor parallelism on one CPU machine (issue 40): TP=2 with one thread per rank against TP=1
with two threads, at the same model and dtype: batch-1 and batch-16 decode, a 512-token
prefill, each rank's resident memory, and where a step's time goes on the driver (its wait in
the all-reduces and the logits gather), beside a bare all-reduce of the same sizes between two
processes with nothing else running (the link's own cost).

    python benchmarks/bench_tensor_parallel.py --model FOLDER [--dtype bfloat16]
        [--sizes 1,2] [--batches 1,16] [--steps 64] [--runs 3] [--json out.json]

FOLDER: an HF checkpoint folder, e.g. the random 0.8B one that bench_llamacpp.py's work folder
holds (W/random-0.8b; benchmarks/random_checkpoint.py writes one). Each size runs in a process of
its own (a process holds one torch.distributed group).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_cpu import DECODE_PROMPT_LEN, MAX_MODEL_LEN, PREFILL_LEN, engine_decode, engine_prefill

CACHE_BYTES = 1 << 30         # per rank


def rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class CollectiveTimer:
    """The driver's time inside the forward's collectives (the all-reduces and the logits
    gather of hybrid_engine/tensor_parallel.py's parallel_for) and in sending each step's
    message (StepChannel.send: its pickling and broadcast)."""

    def __init__(self):
        import dataclasses

        from hybrid_engine import tensor_parallel
        self.seconds = {"all_reduce": 0.0, "gather": 0.0, "send": 0.0}
        self.calls = dict.fromkeys(self.seconds, 0)
        made = tensor_parallel.parallel_for

        def timed_parallel_for(rank: int, size: int):
            tp = made(rank, size)
            return dataclasses.replace(tp, all_reduce=self._timed("all_reduce", tp.all_reduce),
                                       gather_logits=self._timed("gather", tp.gather_logits))

        tensor_parallel.parallel_for = timed_parallel_for
        tensor_parallel.StepChannel.send = self._timed("send", tensor_parallel.StepChannel.send)

    def _timed(self, name, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return call

    def reset(self) -> None:
        for name in self.seconds:
            self.seconds[name], self.calls[name] = 0.0, 0


def one_size(args) -> dict:
    """Runs in its own process: an engine of --size ranks, its figures as JSON on stdout."""
    import torch

    from hybrid_engine.config import EngineConfig
    from hybrid_engine.engine import LLMEngine

    torch.set_num_threads(args.driver_threads)
    timer = CollectiveTimer() if args.size > 1 else None
    importlib.import_module("hybrid_engine.models")     # a worker has imported as much when it loads
    before = rss_mb()
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=max(args.batches),
                                    max_num_batched_tokens=max(2048, max(args.batches) * DECODE_PROMPT_LEN),
                                    max_model_len=MAX_MODEL_LEN, cache_memory_bytes=CACHE_BYTES,
                                    tensor_parallel_size=args.size))
    load_s = time.perf_counter() - t0
    group = engine.tp_group
    pids = [os.getpid()] + ([w.pid for w in group.workers] if group else [])
    weights = {"sharded": 0, "replicated": 0}
    for name, p in engine.model.named_parameters():
        weights["replicated" if "norm" in name else "sharded"] += p.nbytes
    pools = engine.cache.pools
    cache_mb = sum(t.nbytes for t in pools.kv_caches + [pools.conv_layers, pools.recurrent_layers,
                   pools.checkpoint_conv_layers, pools.checkpoint_recurrent_layers, pools.checkpoint_hidden]) / 2**20
    result = {"size": args.size, "cache_mb": cache_mb, "driver_threads": args.driver_threads, "load_s": load_s,
              "rss_mb": [rss_mb(pid) for pid in pids], "rss_before_mb": before, "weight_mb": {k: v / 2**20 for k, v in weights.items()},
              "layers": engine.model_config.num_hidden_layers}
    vocab = engine.model_config.vocab_size
    engine_decode(engine, 1, 4, vocab)                      # warm-up
    for b in args.batches:
        runs = []
        for _ in range(args.runs):
            if timer:
                timer.reset()
            r = engine_decode(engine, b, args.steps, vocab)
            if timer:
                steps = args.steps + 1                      # the prefill step's collectives are counted too
                r["all_reduce_ms_per_step"] = 1e3 * timer.seconds["all_reduce"] / steps
                r["gather_ms_per_step"] = 1e3 * timer.seconds["gather"] / steps
                r["send_ms_per_step"] = 1e3 * timer.seconds["send"] / steps
                r["all_reduces_per_step"] = timer.calls["all_reduce"] / steps
            runs.append(r)
        result[f"decode_b{b}"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    runs = [engine_prefill(engine, vocab, seed=10 + i) for i in range(args.runs)]
    result["prefill"] = {"tok_s": statistics.median(r["tok_s"] for r in runs)}
    engine.shutdown()
    return result


def bare_all_reduce(rank: int, port: int, shapes, dtype_name: str, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    figures = {}
    for rows, hidden in shapes:
        t = torch.ones(rows, hidden, dtype=getattr(torch, dtype_name))
        for _ in range(10):
            dist.all_reduce(t)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(t)
        figures[f"{rows}x{hidden}"] = 1e6 * (time.perf_counter() - t0) / repeats
    if rank == 0:
        out.put(figures)
    dist.destroy_process_group()


def shm_handoff(rank: int, buffer, barrier, repeats: int, out) -> None:
    """A step message handed over in shared memory instead: rank 0 writes the buffer, both
    pass a barrier, rank 1 reads it, both pass another."""
    import torch
    torch.set_num_threads(1)
    local = torch.ones_like(buffer)
    t0 = time.perf_counter()
    for _ in range(repeats):
        if rank == 0:
            buffer.copy_(local)
        barrier.wait()
        if rank == 1:
            local.copy_(buffer)
        barrier.wait()
    if rank == 0:
        out.put(1e6 * (time.perf_counter() - t0) / repeats)


def message_cost(message_bytes: int) -> dict:
    """Microseconds to hand one step message of `message_bytes` to one other process: the
    engine's broadcast (gloo) against a shared-memory buffer with a barrier."""
    import torch
    import torch.multiprocessing as mp

    from hybrid_engine.tensor_parallel import _free_port
    buffer = torch.zeros(message_bytes, dtype=torch.uint8).share_memory_()
    shm = on_two_processes(shm_handoff, lambda: (buffer, mp.get_context("spawn").Barrier(2), 2000))
    broadcast = on_two_processes(bare_broadcast, lambda: (_free_port(), message_bytes, 2000))
    return {"broadcast_us": broadcast, "shared_memory_us": shm}


def on_two_processes(target, make_args):
    """target(rank, *make_args(), queue) in two spawned processes -> what rank 0 puts on the queue."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    args = make_args()
    procs = [ctx.Process(target=target, args=(rank, *args, out)) for rank in range(2)]
    for p in procs:
        p.start()
    figure = out.get(timeout=300)
    for p in procs:
        p.join()
    return figure


def bare_broadcast(rank: int, port: int, message_bytes: int, repeats: int, out) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    t = torch.zeros(message_bytes, dtype=torch.uint8)
    for _ in range(20):
        dist.broadcast(t, 0)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(repeats):
        dist.broadcast(t, 0)
    if rank == 0:
        out.put(1e6 * (time.perf_counter() - t0) / repeats)
    dist.destroy_process_group()


def link_cost(hidden: int, dtype: str, batches: list[int]) -> dict:
    """Microseconds per all-reduce of [rows, hidden] between two one-thread processes."""
    from hybrid_engine.tensor_parallel import _free_port
    shapes = [(b, hidden) for b in batches] + [(PREFILL_LEN, hidden)]
    return on_two_processes(bare_all_reduce, lambda: (_free_port(), shapes, dtype, 200))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="cores in all: TP=N gives each rank threads/N")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)   # a child's one size
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.size is not None:
        args.driver_threads = max(1, args.threads // args.size)
        print(json.dumps(one_size(args)))
        return

    from hybrid_engine.kernels.native.isa import cpu_level
    load_start = os.getloadavg()[0]
    results = []
    for size in [int(s) for s in args.sizes.split(",")]:
        child = [sys.executable, __file__, *sys.argv[1:], "--size", str(size)]
        done = subprocess.run(child, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(
            max(1, args.threads // size))})
        if done.returncode != 0:
            sys.exit(f"TP={size} failed:\n{done.stderr}")
        results.append(json.loads(done.stdout.splitlines()[-1]))
    config = json.loads((Path(args.model) / "config.json").read_text())
    text_config = config.get("text_config", config)
    link = link_cost(text_config["hidden_size"], args.dtype, args.batches)
    from hybrid_engine.tensor_parallel import STEP_MESSAGE_BYTES
    message = message_cost(STEP_MESSAGE_BYTES)

    print(f"{args.model}, {args.dtype}, CPU level {cpu_level()}, {args.threads} cores in all, medians of {args.runs}")
    base = results[0]
    for r in results:
        rss = " + ".join(f"{m - r['rss_before_mb'] - r['cache_mb']:.0f}" for m in r["rss_mb"])
        print(f"TP={r['size']} ({r['driver_threads']} thread(s) per rank): RSS per rank {rss} MB above a process "
              f"that has imported the engine ({r['rss_before_mb']:.0f} MB), less its cache ({r['cache_mb']:.0f} MB); "
              "live weights per rank "
              f"{r['weight_mb']['sharded']:.0f} MB sharded + {r['weight_mb']['replicated']:.0f} MB replicated")
        for b in args.batches:
            d = r[f"decode_b{b}"]
            line = (f"  decode batch {b:>2}: {d['tok_s']:8.1f} tok/s ({d['tok_s'] / base[f'decode_b{b}']['tok_s']:.2f}x "
                    f"TP={base['size']}), step {d['step_ms']:.2f} ms")
            if "all_reduce_ms_per_step" in d:
                line += (f"; driver in all-reduce {d['all_reduce_ms_per_step']:.2f} ms/step "
                         f"({d['all_reduces_per_step']:.0f} calls, "
                         f"{1e3 * d['all_reduce_ms_per_step'] / r['layers']:.0f} us per layer), "
                         f"in the logits gather {d['gather_ms_per_step']:.2f} ms/step, "
                         f"sending the step {d['send_ms_per_step']:.2f} ms/step")
            print(line)
        print(f"  prefill {PREFILL_LEN}: {r['prefill']['tok_s']:8.1f} tok/s "
              f"({r['prefill']['tok_s'] / base['prefill']['tok_s']:.2f}x TP={base['size']})")
    print("one all-reduce alone between two 1-thread processes (gloo, 127.0.0.1): " +
          ", ".join(f"[{shape}] {us:.0f} us" for shape, us in link.items()))
    print(f"one step message ({STEP_MESSAGE_BYTES >> 10} KiB) to the other process: broadcast "
          f"{message['broadcast_us']:.0f} us, shared memory and a barrier {message['shared_memory_us']:.0f} us")
    print(f"load average {load_start:.2f} -> {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"date": datetime.datetime.now().isoformat(timespec="seconds"),
                                         "cpu_level": cpu_level(), "model": args.model, "dtype": args.dtype,
                                         "results": results, "bare_all_reduce_us": link,
                                         "step_message_us": message}, indent=1))


if __name__ == "__main__":
    main()
