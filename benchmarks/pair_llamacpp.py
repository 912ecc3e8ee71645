"""Batch-1 decode against llama.cpp in interleaved pairs: our engine stays loaded in a child
process (benchmarks/ab_decode_child.py, at the level's environment) while llama-bench tg runs
alternate with timed blocks of ours, PAIRS times, and each pair gives a ratio. On this shared
machine both engines' speed drifts 1.5-2x within minutes (other tenants' memory traffic); a
ratio of two runs minutes apart carries that drift, the median of paired ratios much less.
bench_llamacpp.py prepares the weights and builds llama-bench (run it with --prepare-only first).

    python benchmarks/pair_llamacpp.py --model default --engine compiled --levels native,avx2 --pairs 8 \\
        --work-dir /work/llamacpp-work --json pairs.json

Ours: STEPS engine steps of batch-1 greedy decode (the engine's whole step: scheduling, the
forward, sampling, detokenizing), after a warm-up; llama.cpp: llama-bench -p 0 -n STEPS -r 1
(its decode alone). Both at --threads. A quantized --dtype (q8_0, q4_0, q4_k_m: llama-quantize's
file) pairs with ours quantized at load at the same bits (bench_llamacpp.py QUANTIZED), bf16
activations.

--prefill L pairs prefill instead: ours, STEPS fresh L-token prompts a block, each one engine
step that prefills it and emits one token (prefix caching off); llama.cpp, llama-bench -p L -n 0
-r STEPS. Tokens per second of prompt on both sides.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_llamacpp import (GGUF_TYPES, LEVEL_ENV, MODELS, OUR_LEVEL, QUANTIZED, cpu_record,  # noqa: E402
                            detected_level, gguf_path, llama_bench_path, model_folder, run_llama_bench)


def llama_tg(binary: Path, gguf: Path, threads: int, steps: int) -> float:
    return run_llama_bench(binary, gguf, threads, 1, steps, prompt=0)[f"tg{steps}"]["tok_s"]


def llama_pp(binary: Path, gguf: Path, threads: int, prompt: int, runs: int) -> float:
    return run_llama_bench(binary, gguf, threads, runs, 0, prompt=prompt)[f"pp{prompt}"]["tok_s"]


class Ours:
    """ab_decode_child.py in this tree, at a level: `block()` -> tok/s of one timed block."""

    def __init__(self, folder: Path, dtype: str, steps: int, engine: str, level: str, threads: int,
                 omp_wait_policy: str = "default", prefill: int = 0):
        # The child sets torch's thread count from AB_THREADS (default 2), over OMP_NUM_THREADS.
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), AB_THREADS=str(threads),
                   **LEVEL_ENV.get(OUR_LEVEL[level] or "", {}))
        if dtype in QUANTIZED:                  # ours quantized at load, bf16 activations
            env["AB_QUANTIZATION"], dtype = QUANTIZED[dtype].method, "bfloat16"
        if omp_wait_policy != "default":
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        if prefill:
            env["AB_PREFILL"] = str(prefill)
        self.steps, self.tokens_per_step = steps, prefill or 1
        self.proc = subprocess.Popen([sys.executable, str(HERE / "ab_decode_child.py"), str(folder), dtype, str(steps),
                                      "compiled" if engine == "compiled" else "eager"],
                                     cwd=HERE.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        while (line := self.proc.stdout.readline()) and line.strip() != "ready":
            pass
        if not line:
            raise RuntimeError("our engine's child exited before it was ready")

    def block(self) -> float:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return self.steps * self.tokens_per_step / float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="default")
    ap.add_argument("--dtype", default="float32", choices=sorted(GGUF_TYPES) + sorted(QUANTIZED))
    ap.add_argument("--engine", default="compiled", choices=["ours", "compiled"])
    ap.add_argument("--levels", default="native,avx2")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--steps", type=int, default=128, help="decode tokens (--prefill: prompts) per measurement, both engines")
    ap.add_argument("--prefill", type=int, default=0, help="pair prefills of this many tokens instead of decode")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--work-dir", type=Path, default=Path.home() / ".cache" / "hybrid-engine" / "llamacpp")
    ap.add_argument("--omp-wait-policy", default="default", choices=["default", "ACTIVE", "PASSIVE"],
                    help="OMP_WAIT_POLICY of our engine's child (llama.cpp's own threads spin-wait by default)")
    ap.add_argument("--json", type=Path, default=Path("pair_llamacpp.json"))
    args = ap.parse_args()
    folder = model_folder(args.model, args.work_dir, None)
    gguf = gguf_path(args.work_dir, args.model, args.dtype)
    if not gguf.exists():
        raise SystemExit(f"{gguf} is missing: run bench_llamacpp.py --model {args.model} --prepare-only first")
    started = datetime.datetime.now().isoformat(timespec="seconds")
    results = []
    for level in args.levels.split(","):
        binary = llama_bench_path(args.work_dir, level)
        if not binary.exists():
            raise SystemExit(f"{binary} is not built: run bench_llamacpp.py --build --prepare-only first")
        ours = Ours(folder, args.dtype, args.steps, args.engine, level, args.threads, args.omp_wait_policy,
                    prefill=args.prefill)

        def llama() -> float:
            if args.prefill:
                return llama_pp(binary, gguf, args.threads, args.prefill, args.steps)
            return llama_tg(binary, gguf, args.threads, args.steps)
        pairs = []
        try:
            for i in range(args.pairs):
                if i % 2 == 0:
                    theirs = llama()
                    mine = ours.block()
                else:
                    mine = ours.block()
                    theirs = llama()
                pairs.append({"ours_tok_s": mine, "llama_tok_s": theirs, "ratio": mine / theirs})
                print(f"{level} pair {i}: ours {mine:.1f} tok/s, llama.cpp {theirs:.1f} tok/s, ratio {mine / theirs:.2f}",
                      flush=True)
        finally:
            ours.close()
        ratios = sorted(p["ratio"] for p in pairs)
        row = {"level": level, "cpu_isa": OUR_LEVEL[level] or detected_level(), "pairs": pairs,
               "median_ratio": statistics.median(ratios), "ratio_range": [ratios[0], ratios[-1]],
               "median_ours_tok_s": statistics.median(p["ours_tok_s"] for p in pairs),
               "median_llama_tok_s": statistics.median(p["llama_tok_s"] for p in pairs)}
        results.append(row)
        print(f"{level} ({row['cpu_isa']}): median ratio {row['median_ratio']:.2f} "
              f"(range {ratios[0]:.2f}-{ratios[-1]:.2f}; ours {row['median_ours_tok_s']:.0f}, "
              f"llama.cpp {row['median_llama_tok_s']:.0f} tok/s medians)", flush=True)
    meta = {"started": started, "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.executable).name] + sys.argv), "model": args.model, "dtype": args.dtype,
            "engine": args.engine, "threads": args.threads, "omp_wait_policy": args.omp_wait_policy, "steps": args.steps, "prefill": args.prefill, "gguf": str(gguf),
            "cpu": cpu_record(), "load_end": os.getloadavg()}
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(f"JSON in {args.json}")


if __name__ == "__main__":
    main()
