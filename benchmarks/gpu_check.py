"""GPU check of the triton backend (issue 5), sized for one H200 and 8 minutes in all.

    python benchmarks/gpu_check.py [--json out.json] [--skip-tests] [--budget-s 480]

1. tests/triton compiled (no interpreter): every triton op against the torch op in float32,
   the bf16 tests at Qwen3.5-0.8B dimensions (test_triton_gpu_bf16.py), the end-to-end
   generation, the CUDA-graph helper; host-side precondition checks on
   (HYBRID_ENGINE_KERNEL_CHECKS=1).
2. A random-weight model at Qwen3.5-0.8B dimensions in bfloat16 on the triton backend:
   prefill tok/s for one 2048-token prompt; decode tok/s at batch 1, 16 and 64 (greedy, EOS
   ignored, the prefill step excluded); the same decode with MTP k=2. Random MTP weights
   accept few drafts, so the k=2 numbers bound the speculative speed-up from below.
3. Batch-1 decode against the HBM roofline: weight bytes read per step / 4.8 TB/s.

Prints one summary. Every phase is bounded by what is left of --budget-s; a phase that fails
is reported and the rest still run.

Needs CUDA torch, triton, fla-core 0.6.0 and this project importable. On a lent machine
with no network, from the repo root here: `echo /.whl/ >> .git/info/exclude`, then
`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
-d .whl fla-core==0.6.0`, and there (carry .whl):
`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl &&
export PYTHONPATH=/tmp/site && python3 -m pip install -q --no-deps --no-build-isolation -e . &&
python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_checkpoint import QWEN35_08B_CONFIG, write_random_checkpoint  # noqa: E402
HBM_BYTES_PER_S = 4.8e12
PREFILL_LEN = 2048
DECODE_PROMPT_LEN = 64
DECODE_TOKENS = 32
BATCHES = (1, 16, 64)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_tests(budget: Budget) -> dict:
    env = dict(os.environ, HYBRID_ENGINE_TRITON_TESTS="1", HYBRID_ENGINE_KERNEL_CHECKS="1",
               PYTHONUNBUFFERED="1")
    timeout = max(30.0, min(240.0, budget.left() - 200))
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests/triton", "-q", "-rfEs", "-p", "no:cacheprovider"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return {"ok": False, "summary": f"timed out after {timeout:.0f}s", "tail": out[-3000:]}
    lines = proc.stdout.strip().splitlines()
    summary = next((ln for ln in reversed(lines) if re.search(r"\d+ (passed|failed|error)", ln)), "")
    return {"ok": proc.returncode == 0, "summary": summary.strip("= "), "seconds": time.monotonic() - t0,
            "tail": "" if proc.returncode == 0 else (proc.stdout + proc.stderr)[-3000:]}


def write_model(folder: Path) -> None:
    import torch

    with torch.device("cuda"):                          # random init on the GPU: seconds, not minutes
        write_random_checkpoint(folder, QWEN35_08B_CONFIG, seed=0)


def make_llm(folder: Path, spec: dict | None, enforce_eager: bool = False):
    from hybrid_engine import LLM

    # CUDA graphs for decode/verify at the batch sizes benchmarked (capture at start-up).
    return LLM(model=str(folder), dtype="bfloat16", device="cuda", max_num_seqs=max(BATCHES),
               max_num_batched_tokens=max(PREFILL_LEN, max(BATCHES) * DECODE_PROMPT_LEN),
               max_model_len=PREFILL_LEN + 64, speculative_config=spec, enforce_eager=enforce_eager,
               cuda_graph_batch_sizes=None if enforce_eager else list(BATCHES))


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, QWEN35_08B_CONFIG["vocab_size"], (n, length), generator=g).tolist()


def prefill_tok_s(engine, runs: int = 3) -> float:
    from hybrid_engine import SamplingParams

    best = 0.0
    for seed in range(runs + 1):                        # the first run compiles the kernels
        engine.add_request(prompts(1, PREFILL_LEN, seed)[0], SamplingParams(temperature=0.0, max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if seed:
            best = max(best, PREFILL_LEN / (time.perf_counter() - t0))
    return best


def decode_tok_s(engine, batch: int) -> dict:
    """Aggregate generated tokens/s over the steps after the prefill step."""
    from hybrid_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS + 1, ignore_eos=True)
    for p in prompts(batch, DECODE_PROMPT_LEN, seed=100 + batch):
        engine.add_request(p, params)
    engine.step()                                       # all prompts fit one prefill step
    tokens, steps = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        steps += 1
    elapsed = time.perf_counter() - t0
    return {"tok_s": tokens / elapsed, "step_ms": 1e3 * elapsed / max(steps, 1), "steps": steps}


def benchmark(budget: Budget, results: dict) -> None:
    import torch

    from hybrid_engine import kernels

    kernels.set_backend("auto")                         # CUDA tensors: the triton backend
    folder = Path(tempfile.mkdtemp(prefix="qwen35-0.8b-random-"))
    t0 = time.monotonic()
    write_model(folder)
    results["model_write_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    llm = make_llm(folder, None)
    engine = llm.engine
    results["engine_start_s"] = time.monotonic() - t0
    from hybrid_engine.cuda_graph_steps import CudaGraphSteps
    graphs = engine.runner.execution
    results["cuda_graphs"] = (f"on, batch buckets {graphs.buckets}" if isinstance(graphs, CudaGraphSteps)
                              else "off")
    main = [p for n, p in engine.model.named_parameters() if not n.startswith("mtp.")]
    weight_bytes = sum(p.numel() * p.element_size() for p in main)
    results["weight_bytes"] = weight_bytes
    roofline_ms = 1e3 * weight_bytes / HBM_BYTES_PER_S
    results["roofline_b1_ms"] = roofline_ms

    decode_tok_s(engine, 1)                             # warm-up: compiles the decode kernels
    if budget.left() > 60:
        results["prefill_2k_tok_s"] = prefill_tok_s(engine)
    for b in BATCHES:
        if budget.left() > 30:
            results[f"decode_b{b}"] = decode_tok_s(engine, b)
    if "decode_b1" in results:
        results["decode_b1_vs_roofline"] = roofline_ms / results["decode_b1"]["step_ms"]
    del llm, engine
    torch.cuda.empty_cache()
    if budget.left() > 150:                             # what the graphs buy at batch 1
        llm = make_llm(folder, None, enforce_eager=True)
        decode_tok_s(llm.engine, 1)
        results["decode_b1_eager"] = decode_tok_s(llm.engine, 1)
        del llm
        torch.cuda.empty_cache()

    if budget.left() < 60:
        results["mtp_k2"] = "skipped: out of time"
        return
    llm = make_llm(folder, {"method": "mtp", "num_speculative_tokens": 2})
    engine = llm.engine
    decode_tok_s(engine, 1)
    mtp = {}
    for b in BATCHES:
        if budget.left() > 30:
            mtp[f"decode_b{b}"] = decode_tok_s(engine, b)
    stats = getattr(engine, "spec_stats", None)
    if stats is not None:
        mtp["acceptance_rate"] = stats.acceptance_rate
    results["mtp_k2"] = mtp


def summary(results: dict) -> str:
    lines = ["", "==== hybrid-engine GPU check (triton backend) ===="]
    lines.append(f"device: {results.get('device')}  torch {results.get('torch')}  triton {results.get('triton')}")
    tests = results.get("tests", {})
    lines.append(f"tests/triton (compiled): {'PASS' if tests.get('ok') else 'FAIL'}  {tests.get('summary', 'not run')}")
    lines.append(f"CUDA graphs: {results.get('cuda_graphs', 'not reached')}")
    if "prefill_2k_tok_s" in results:
        lines.append(f"prefill, one {PREFILL_LEN}-token prompt: {results['prefill_2k_tok_s']:,.0f} tok/s")
    for b in BATCHES:
        r = results.get(f"decode_b{b}")
        if r:
            lines.append(f"decode batch {b:>2}: {r['tok_s']:,.0f} tok/s ({r['step_ms']:.2f} ms/step)")
    if "decode_b1_eager" in results:
        r = results["decode_b1_eager"]
        lines.append(f"decode batch  1 without graphs (enforce_eager): {r['tok_s']:,.0f} tok/s ({r['step_ms']:.2f} ms/step)")
    if "roofline_b1_ms" in results:
        lines.append(f"batch-1 roofline: {results['weight_bytes'] / 1e9:.2f} GB weights / 4.8 TB/s = "
                     f"{results['roofline_b1_ms']:.3f} ms/step"
                     + (f"; measured step is {100 * results['decode_b1_vs_roofline']:.1f}% of roofline speed"
                        if "decode_b1_vs_roofline" in results else ""))
    mtp = results.get("mtp_k2")
    if isinstance(mtp, dict):
        for b in BATCHES:
            r = mtp.get(f"decode_b{b}")
            if r:
                lines.append(f"MTP k=2 decode batch {b:>2}: {r['tok_s']:,.0f} tok/s ({r['step_ms']:.2f} ms/step)")
        if "acceptance_rate" in mtp:
            lines.append(f"MTP k=2 acceptance (random weights): {mtp['acceptance_rate']:.3f}")
    elif mtp:
        lines.append(f"MTP k=2: {mtp}")
    for err in results.get("errors", []):
        lines.append(f"ERROR: {err.splitlines()[-1] if err else err}")
    lines.append(f"total: {results.get('total_s', 0):.0f} s")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write every number to this file")
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--budget-s", type=float, default=480.0)
    args = ap.parse_args()
    t_start = time.monotonic()
    budget = Budget(args.budget_s - 15)

    import torch
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check (the interpreter tests run via .ci/run_triton)")
        return 2
    import triton
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                     "triton": triton.__version__, "errors": []}
    if not args.skip_tests:
        results["tests"] = run_tests(budget)
        if results["tests"].get("tail"):
            print(results["tests"]["tail"])
    try:
        benchmark(budget, results)
    except Exception:
        results["errors"].append(traceback.format_exc())
        print(results["errors"][-1])
    results["total_s"] = time.monotonic() - t_start
    print(summary(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    ok = results.get("tests", {}).get("ok", args.skip_tests) and not results["errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
