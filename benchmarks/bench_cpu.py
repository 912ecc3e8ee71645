"""CPU benchmark: this engine versus transformers `generate`, side by side on the same random weights.

    python benchmarks/bench_cpu.py                          # tiny + 0.8B dims, float32 + bfloat16
    python benchmarks/bench_cpu.py --only tiny --quick      # about a minute
    python benchmarks/bench_cpu.py --only 0.8b --dtypes float32 --threads 2 --json out.json

Every (model, dtype, engine) runs in a fresh child process, one after another with the same
thread count, so each peak RSS is its own and one engine's memory never slows the other.
The tiny model is the packaged default model (hybrid_engine/assets/default_model); the 0.8B
random checkpoint (about 3 GB, float32) is written once to --cache-dir. Both engines load the
same files (the bfloat16 runs cast at load time).

Engines: ours (eager), compiled (ours with enable_torch_compile: decode, verify and MTP passes
through torch.compile; its warm-up compiles, and the JSON's warmup_s says how long that took) and
hf (transformers). Per engine, medians of --runs:
- prefill tokens/s: one 512-token prompt, one new token;
- decode tokens/s at batch 1 and aggregate at batch 4/16/32: each request a 32-token prompt,
  then greedy tokens with EOS ignored; the prefill step is excluded (ours: the steps after the
  first; transformers: generate(N+1 tokens) - generate(1 token));
- the share of a decode step spent outside the model forward (ours: engine.step minus
  runner.forward; transformers: generate minus model.forward);
- peak RSS of the child process;
- where the model has an MTP head (the tiny default model), `hybrid-engine bench` in its own
  child: batch-1 greedy decode with k = 1, 2, 3 drafts against k = 0 on the built-in code
  prompts (random-weight checkpoints have no MTP head), wall-clock speedup per k.
And the batch-1 roofline: bytes of weights and state read per decode step divided by the read
bandwidth measured here (best of several multi-threaded reads of a 2 GiB tensor).

On a shared machine, quote the load average printed with the table. With 2 threads and a busy
neighbour, every OpenMP fork-join waits for a time slice and OpenMP's default spin-waiting makes
small ops 5-10x slower: there, pass --omp-wait-policy PASSIVE (both engines alike). On a quiet
machine leave the default (spinning), which is up to 20% faster at batch 16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint

PREFILL_LEN = 512
DECODE_PROMPT_LEN = 32
MAX_MODEL_LEN = 640          # covers the prefill prompt and every decode request


# ---- child side: one engine, one model, one dtype -------------------------------------------

def prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


class ForwardTimer:
    """Wraps a callable and sums the wall time spent inside it."""

    def __init__(self, fn):
        self.fn, self.total, self.calls = fn, 0.0, []

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.calls.append(time.perf_counter() - t)
        return out

    def reset(self):
        self.calls = []


def engine_decode(engine, batch: int, new_tokens: int, vocab: int, seed: int = 0) -> dict:
    """Decode `new_tokens` steps for `batch` requests on a hybrid_engine LLMEngine."""
    from hybrid_engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens + 1, ignore_eos=True)
    for p in prompts(vocab, batch, DECODE_PROMPT_LEN, seed):
        engine.add_request(p, params)
    engine.step()                                   # every prompt fits one prefill step
    timer = engine.runner.forward = ForwardTimer(type(engine.runner).forward.__get__(engine.runner))
    steps, t0 = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    del engine.runner.forward
    assert steps == new_tokens, (steps, new_tokens)
    forward = sum(timer.calls)
    return {"tok_s": batch * steps / elapsed, "step_ms": 1e3 * elapsed / steps,
            "forward_ms": 1e3 * forward / steps, "outside_share": 1 - forward / elapsed}


def engine_prefill(engine, vocab: int, seed: int = 1) -> dict:
    from hybrid_engine import SamplingParams
    engine.add_request(prompts(vocab, 1, PREFILL_LEN, seed)[0], SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return {"tok_s": PREFILL_LEN / (time.perf_counter() - t0)}


def make_engine(folder: str, dtype: str, max_batch: int, compile: bool = False, prefix_caching: bool = True,
                quantization: str | None = None, quantization_group_size: int | None = None):
    """An LLMEngine stepped on the caller's thread (no LLM: its loop thread would be a second
    thread running torch's parallel ops, which halves small steps; hybrid_engine/engine_loop.py).
    quantization: None (float weights), "int8" or "int4": the projections quantized at load, in
    groups of quantization_group_size (None: the engine's default, 32); dtype is then the
    activations' (and the float tensors')."""
    from hybrid_engine.config import EngineConfig
    from hybrid_engine.engine import LLMEngine
    return LLMEngine(EngineConfig(model=folder, dtype=dtype, max_num_seqs=max_batch,
                                  max_num_batched_tokens=max(2048, max_batch * DECODE_PROMPT_LEN),
                                  max_model_len=MAX_MODEL_LEN, enable_torch_compile=compile,
                                  enable_prefix_caching=prefix_caching, quantization=quantization,
                                  quantization_group_size=quantization_group_size if quantization else None))


def quantized_weight_bytes(model) -> dict:
    """What a loaded model's quantized projections hold, against the float weights they replace:
    packed (their int8 / int4 values, float16 scales, any zero points and float tail rows, as
    the kernel reads them) and float (their weights' shapes at the activation dtype). A decode
    step reads the packed bytes in place of the float ones; the rest of the model is read as
    before."""
    packed = float_equivalent = layers = 0
    for module in model.modules():
        if getattr(module, "qweight", None) is None:
            continue
        extras = (getattr(module, name, None) for name in ("qzeros", "float_tail"))
        packed += module.qweight.nbytes + sum(t.nbytes for t in extras if t is not None)
        float_equivalent += module.weight.numel() * module.weight.element_size()   # a meta tensor: shape and dtype
        layers += 1
    return {"packed": packed, "float": float_equivalent, "layers": layers}


def hf_generate(model, ids, new_tokens: int, timer: ForwardTimer) -> float:
    import torch
    timer.reset()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def hf_decode(model, timer, batch: int, new_tokens: int, vocab: int, seed: int = 0) -> dict:
    import torch
    ids = torch.tensor(prompts(vocab, batch, DECODE_PROMPT_LEN, seed))
    t1 = hf_generate(model, ids, 1, timer)
    tn = hf_generate(model, ids, new_tokens + 1, timer)
    elapsed = tn - t1
    forward = sum(timer.calls[1:])                  # the decode forwards of the long run
    return {"tok_s": batch * new_tokens / elapsed, "step_ms": 1e3 * elapsed / new_tokens,
            "forward_ms": 1e3 * forward / new_tokens, "outside_share": 1 - forward / elapsed}


def hf_prefill(model, timer, vocab: int, seed: int = 1) -> dict:
    import torch
    ids = torch.tensor(prompts(vocab, 1, PREFILL_LEN, seed))
    return {"tok_s": PREFILL_LEN / hf_generate(model, ids, 1, timer)}


def peak_rss_gb() -> float:
    """VmHWM: unlike ru_maxrss, it starts afresh at exec, so a child does not inherit the parent's."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def run_child(job: dict) -> dict:
    import torch
    torch.set_num_threads(job["threads"])
    if job["engine"] == "probe":
        return bandwidth_probe()
    if job["engine"] == "mtp":
        return mtp_bench(job)
    vocab = job["vocab"]
    t0 = time.perf_counter()
    if job["engine"] in ("ours", "compiled"):
        compiled = job["engine"] == "compiled"
        # the compiled warm-up runs batch 2 (below), which max_num_seqs 1 would run one request at a time
        engine = make_engine(job["folder"], job["dtype"], max(job["batches"] + [2] * compiled), compiled,
                             quantization=job.get("quantization"),
                             quantization_group_size=job.get("quantization_group_size"))
        prefill = lambda: engine_prefill(engine, vocab)
        decode = lambda b, n: engine_decode(engine, b, n, vocab)
    else:
        import transformers
        transformers.logging.set_verbosity_error()
        model = transformers.AutoModelForCausalLM.from_pretrained(
            job["folder"], dtype=getattr(torch, job["dtype"])).eval()
        timer = ForwardTimer(model.forward)
        model.forward = timer
        prefill = lambda: hf_prefill(model, timer, vocab)
        decode = lambda b, n: hf_decode(model, timer, b, n, vocab)
    load_s = time.perf_counter() - t0
    rss_loaded = peak_rss_gb()
    t0 = time.perf_counter()
    decode(1, 2)                                    # warm-up: first-call allocations, lazy inits
    if job["engine"] == "compiled":                 # compiles the batch-1 and the any-batch graphs
        decode(1, 4), decode(2, 4)
    warmup_s = time.perf_counter() - t0
    runs: dict[str, list[dict]] = {}
    for _ in range(job["runs"]):
        if job["prefill"]:
            runs.setdefault("prefill", []).append(prefill())
        for b in job["batches"]:
            runs.setdefault(f"decode_b{b}", []).append(decode(b, job["new_tokens"]))
    result = {key: {name: statistics.median(r[name] for r in rs) for name in rs[0]}
              for key, rs in runs.items()}
    result["runs"] = runs
    result["load_s"] = load_s
    result["warmup_s"] = warmup_s
    result["rss_after_load_gb"] = rss_loaded
    if job.get("quantization"):
        result["quantized_weights"] = quantized_weight_bytes(engine.model)
    result["peak_rss_gb"] = peak_rss_gb()
    return result


def bandwidth_probe(gib: float = 2.0, repeats: int = 7) -> dict:
    """Best read bandwidth over a few read-only passes of a tensor far larger than the caches.

    A plain sum() is limited by its own reduction; a GEMV (the op batch-1 decode is made of) and
    amax by their per-element work on some CPUs; `stream` (stream_read.c, built with the
    engine's compiler) does nothing but load. The best of them is the roofline's bandwidth. One
    figure only holds for the moment it was taken (a Zen 3 VM drifted 17-30 GB/s within
    minutes), so a roofline share wants a probe taken next to the run it divides.
    """
    import torch
    x = torch.empty(int(gib * 2**30) // 4).normal_()
    w, v = x.view(-1, 4096), torch.randn(4096)
    probes = {"mv": lambda: torch.mv(w, v), "amax": lambda: x.amax(), "sum": lambda: x.sum()}
    stream = stream_reader()
    if stream is not None:
        threads = torch.get_num_threads()
        probes["stream"] = lambda: stream(x.data_ptr(), x.numel(), threads)
    best = {}
    for name, fn in probes.items():
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        best[name] = x.numel() * 4 / min(times) / 1e9
    return {"gb_s": max(best.values()), "by_probe_gb_s": best, "tensor_gib": gib}


def stream_reader():
    """stream_read.c's stream_read(ptr, floats, threads) through ctypes, built for this process's
    CPU level into the engine's kernel cache; None (with a warning) where it cannot be built."""
    import ctypes
    import hashlib
    import warnings
    from hybrid_engine.kernels.native import build
    from hybrid_engine.kernels.native.isa import cpu_level
    source = Path(__file__).with_name("stream_read.c")
    try:
        cc = build._compiler()
        flags = ["-O3", "-fopenmp", "-fPIC", "-shared", *build.LEVEL_FLAGS.get(cpu_level(), [])]
        key = hashlib.sha256(source.read_bytes() + " ".join([cc, *flags]).encode()).hexdigest()[:16]
        cache = Path(os.environ.get("HYBRID_ENGINE_CACHE_DIR", Path.home() / ".cache" / "hybrid-engine"))
        library = cache / f"stream_read-{key}.so"
        if not library.exists():
            cache.mkdir(parents=True, exist_ok=True)
            partial = library.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([cc, "-x", "c", *flags, str(source), "-o", str(partial)], check=True, capture_output=True)
            os.replace(partial, library)
        fn = ctypes.CDLL(str(library)).stream_read
    except (OSError, subprocess.CalledProcessError) as e:
        warnings.warn(f"bandwidth_probe: stream_read.c could not be built ({e}); torch probes only")
        return None
    fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


# ---- parent side -----------------------------------------------------------------------------

def model_config(name: str) -> dict:
    if name == "0.8b":
        return QWEN35_08B_CONFIG
    from hybrid_engine.default_model import default_model_path
    return json.loads((default_model_path() / "config.json").read_text())


def checkpoint(name: str, cache_dir: Path) -> Path:
    """The tiny model is the packaged default model; the 0.8B one is random, written once."""
    if name == "tiny":
        from hybrid_engine.default_model import default_model_path
        return default_model_path()
    folder = cache_dir / f"random-{name}"
    if not (folder / "model.safetensors").exists():
        print(f"writing the random {name} checkpoint to {folder} (once)...", flush=True)
        write_random_checkpoint(folder, QWEN35_08B_CONFIG)
    return folder


def bytes_per_decode_step(config: dict, dtype: str, context: int) -> dict:
    """Bytes a batch-1 decode step must read: every weight once (a tied embedding once, as
    lm_head), each GDN layer's recurrent state (float32) and conv window, and the KV cache."""
    import torch
    import math
    from hybrid_engine.models import HybridForCausalLM, checkpoint_shapes, parse_config
    cfg = parse_config(config)
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=False)
    itemsize = getattr(torch, dtype).itemsize
    weights = sum(math.prod(shape) for shape in checkpoint_shapes(model).values()) * itemsize
    if not cfg.tie_word_embeddings:                 # the input embedding is read one row at a time
        weights -= model.embed_tokens.weight.numel() * itemsize
    n_gdn, n_attn = len(cfg.linear_attention_layers), len(cfg.full_attention_layers)
    state = n_gdn * (cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
                     + cfg.conv_dim * (cfg.linear_conv_kernel_dim - 1) * itemsize)
    kv = n_attn * context * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return {"weights": weights, "state": state, "kv": kv, "total": weights + state + kv}


def spawn(job: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), PYTHONWARNINGS="ignore")
    if job["omp_wait_policy"] != "default":
        env["OMP_WAIT_POLICY"] = job["omp_wait_policy"]
    load = os.getloadavg()[0]
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(job)], env=env,
                          stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"child {job} failed ({proc.returncode})")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_before"], result["load_after"] = load, os.getloadavg()[0]
    return result


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def mtp_bench(job: dict) -> dict:
    """`hybrid-engine bench` (k = 0..3, batch 1, greedy, medians of --runs) in this process."""
    import tempfile

    from hybrid_engine.cli import main as cli_main
    out = Path(tempfile.mkdtemp()) / "mtp.json"
    argv = ["bench", "--model", job["folder"], "--dtype", job["dtype"], "--max-k", "3",
            "--repeats", str(job["runs"]), "--json", str(out)] + (["--torch-compile"] if job["compiled"] else [])
    if cli_main(argv) != 0:
        raise RuntimeError(f"hybrid-engine {' '.join(argv)} failed")
    report = json.loads(out.read_text())
    return {"by_k": {r["k"]: {"speedup": r["speedup"], "tok_s": r["output_tokens_per_s"],
                              "mean_accept_length": r["mean_accept_length"],
                              "greedy_identical": r["greedy_identical"]} for r in report["results"]},
            "best_k": report["best_k"], "best_speedup": report["best_speedup"]}


def fmt_row(cells, widths):
    return " | ".join(str(c).rjust(w) for c, w in zip(cells, widths))


def print_table(results: list[dict], batches: list[int], bandwidth: dict, threads: int) -> None:
    head = ["model", "dtype", "engine", "prefill512 t/s"] + [f"b{b} t/s" for b in batches] + \
           [f"out b{b}" for b in batches if b in (1, 16)] + ["roofline", "peak RSS GB", "MTP k1/k2/k3", "load"]
    widths = [max(len(h), 6) for h in head]
    widths[2] = len("compiled/hf")
    print(f"\nthreads {threads} (OMP_WAIT_POLICY {results[0]['omp_wait_policy'] if results else '-'}); read bandwidth {bandwidth['gb_s']:.1f} GB/s "
          f"(best probe of {', '.join(f'{k} {v:.1f}' for k, v in bandwidth['by_probe_gb_s'].items())})")
    print(fmt_row(head, widths))
    print("-+-".join("-" * w for w in widths))
    by_key = {(r["model"], r["dtype"], r["engine"]): r for r in results}

    def row(r, ref=None):
        def val(key, field="tok_s"):
            if key not in r:
                return "-"
            x = r[key][field]
            if ref is not None:
                return f"{x / ref[key][field]:.2f}x" if key in ref else "-"
            return f"{x:.1f}" if x < 1000 else f"{x:.0f}"
        cells = [r["model"], r["dtype"], f"{r['engine']}/hf" if ref else r["engine"], val("prefill")]
        cells += [val(f"decode_b{b}") for b in batches]
        cells += ["-" if ref or f"decode_b{b}" not in r else f"{100 * r[f'decode_b{b}']['outside_share']:.1f}%"
                  for b in batches if b in (1, 16)]
        roof = r.get("roofline_fraction")
        mtp = r.get("mtp", {}).get("by_k")
        cells += ["-" if ref or roof is None else f"{100 * roof:.0f}%",
                  "-" if ref else f"{r['peak_rss_gb']:.2f}",
                  "-" if ref or not mtp else "/".join(f"{mtp[str(k)]['speedup']:.2f}" for k in (1, 2, 3)) + "x",
                  "-" if ref else f"{r['load_before']:.1f}"]
        return fmt_row(cells, widths)

    for r in results:
        print(row(r))
        if r["engine"] == "hf":
            for engine in ("ours", "compiled"):
                if (r["model"], r["dtype"], engine) in by_key:
                    print(row(by_key[r["model"], r["dtype"], engine], ref=r))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=["tiny", "0.8b"], default=["tiny", "0.8b"])
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--engines", default="ours,compiled,hf",
                    help="ours: eager; compiled: ours with enable_torch_compile; hf: transformers generate")
    ap.add_argument("--batches", default="1,4,16,32")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--omp-wait-policy", default="default", choices=["default", "PASSIVE", "ACTIVE"])
    ap.add_argument("--new-tokens", type=int, default=None,
                    help="decode steps per measurement (default: tiny 128, 0.8b 16; --quick: 32 / 8)")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer tokens, batches 1 and 16")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/hybrid-engine-bench"))
    ap.add_argument("--json", type=Path, default=Path("bench_cpu.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    batches = [1, 16] if args.quick and args.batches == "1,4,16,32" else [int(b) for b in args.batches.split(",")]
    started = datetime.datetime.now().isoformat(timespec="seconds")
    load_start = os.getloadavg()
    bandwidth = spawn(dict(engine="probe", threads=args.threads, omp_wait_policy=args.omp_wait_policy))
    results = []
    for name in args.only:
        config = model_config(name)
        folder = checkpoint(name, args.cache_dir)
        new_tokens = args.new_tokens or {("tiny", False): 128, ("tiny", True): 32,
                                         ("0.8b", False): 16, ("0.8b", True): 8}[name, args.quick]
        for dtype in args.dtypes.split(","):
            step_bytes = bytes_per_decode_step(config, dtype, DECODE_PROMPT_LEN + new_tokens // 2)
            for engine in args.engines.split(","):
                job = dict(engine=engine, model=name, dtype=dtype, folder=str(folder), threads=args.threads,
                           vocab=config["vocab_size"], batches=batches, new_tokens=new_tokens,
                           runs=args.runs, prefill=not args.no_prefill, omp_wait_policy=args.omp_wait_policy)
                print(f"running {engine} {name} {dtype} ...", flush=True)
                r = spawn(job)
                r.update(engine=engine, model=name, dtype=dtype, new_tokens=new_tokens, omp_wait_policy=args.omp_wait_policy,
                         bytes_per_step=step_bytes)
                if engine in ("ours", "compiled") and name == "tiny":
                    print(f"running hybrid-engine bench (MTP k=1..3) {name} {dtype} {engine} ...", flush=True)
                    r["mtp"] = spawn(dict(job, engine="mtp", compiled=engine == "compiled"))
                if "decode_b1" in r:
                    roofline_ms = 1e3 * step_bytes["total"] / (bandwidth["gb_s"] * 1e9)
                    r["roofline_step_ms"] = roofline_ms
                    r["roofline_fraction"] = roofline_ms / r["decode_b1"]["step_ms"]
                results.append(r)
    print_table(results, batches, bandwidth, args.threads)
    meta = {"started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "threads": args.threads,
            "omp_wait_policy": args.omp_wait_policy,
            "cpu_count": os.cpu_count(), "machine": cpu_name(),
            "load_start": load_start, "load_end": os.getloadavg()}
    import torch
    import transformers
    meta["torch"], meta["transformers"] = torch.__version__, transformers.__version__
    args.json.write_text(json.dumps({"meta": meta, "bandwidth": bandwidth, "results": results}, indent=1))
    print(f"\nload average start {load_start[0]:.2f}, end {os.getloadavg()[0]:.2f}; JSON in {args.json}")


if __name__ == "__main__":
    main()
