"""Structured outputs' cost (issue 41): the per-step time of decoding with and without a JSON
schema constraint at batch 1 and 16, and each schema's compile time.

    python benchmarks/bench_structured.py [--model default|0.8b] [--threads 2] [--steps 64]
                                          [--runs 3] [--mtp] [--json out.json]

The step time is taken in the steady state: B requests always in flight (a request that ends,
as a constrained one does when its object closes, is replaced at once), and only the steps
that decode all B of them and admit none are counted; their median is reported. Every request
samples at temperature 1.0 (seeded), constrained or not, so the two differ by the grammar
alone: filling each row's token mask and applying it. The constrained requests cycle through
examples/json_schemas.py's five schemas.

MTP (--mtp, default model): batch-1 greedy constrained decoding through the five schemas at
k = 0, 2, 4 (tokens/s over all of them, each k a fresh engine), with the drafts masked by the
grammar (the engine's way) and without (the drafter's unconstrained argmax), and the
acceptance rates.

Compile time: each schema compiled cold (a fresh compiler, so nothing is cached) against the
model's vocabulary, median of --runs; plus the vocabulary's tables, built once per engine at
its first constrained request.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from bench_cpu import DECODE_PROMPT_LEN, make_engine, prompts  # noqa: E402
from json_schemas import SCHEMAS  # noqa: E402


def model_folder(model: str, work: Path) -> str:
    if model == "default":
        from hybrid_engine.default_model import default_model_path
        return str(default_model_path())
    folder = work / "random-0.8b"
    if not (folder / "tokenizer.json").exists():
        raise SystemExit(f"{folder} has no Qwen3.5 tokenizer: run benchmarks/bench_llamacpp.py --model 0.8b once "
                         "(it writes the checkpoint and its tokenizer there), or pass --work-dir")
    return str(folder)


def steady_step_ms(engine, batch: int, steps: int, constrained: bool, vocab: int, seed: int) -> float:
    """Median ms of the steps that decode `batch` requests and admit none."""
    from hybrid_engine import SamplingParams, StructuredOutputsParams

    schemas = list(SCHEMAS.values())
    made = 0

    def add():
        nonlocal made
        if constrained:
            params = SamplingParams(temperature=1.0, seed=seed + made, max_tokens=512,
                                    structured_outputs=StructuredOutputsParams(json=schemas[made % len(schemas)]))
        else:
            params = SamplingParams(temperature=1.0, seed=seed + made, max_tokens=512, ignore_eos=True)
        engine.add_request(prompts(vocab, 1, DECODE_PROMPT_LEN, seed + made)[0], params)
        made += 1

    times = []
    while len(times) < steps:
        added = 0
        while len(engine.scheduler.running) + len(engine.scheduler.waiting) < batch:
            add()
            added += 1
        decoding = len(engine.scheduler.running)
        t0 = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t0
        if not added and decoding == batch:
            times.append(elapsed)
    for req_id in list(engine.requests):
        engine.abort_request(req_id)
    return 1e3 * statistics.median(times)


def mtp_rows(folder: str, dtype: str, runs: int) -> dict:
    """Constrained greedy decoding at batch 1 with k = 0, 2, 4: tok/s (median of `runs`) and
    acceptance, with grammar-aware drafts and with unmasked ones."""
    from hybrid_engine import SamplingParams, StructuredOutputsParams
    from hybrid_engine.config import EngineConfig
    from hybrid_engine.engine import LLMEngine
    from hybrid_engine.request_grammar import DraftMasks

    prompts = ["def read_config(path):", "import json\n", "# settings\n", "class Record:\n"]
    result = {}
    for k, masked in ((0, True), (2, True), (2, False), (4, True), (4, False)):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        engine = LLMEngine(EngineConfig(model=folder, dtype=dtype, speculative_config=spec, max_num_seqs=1))
        of = DraftMasks.of
        if not masked:
            DraftMasks.of = classmethod(lambda cls, drafting: None)
        try:
            rates = []
            for run in range(runs):
                tokens, t0 = 0, time.perf_counter()
                for i, schema in enumerate(list(SCHEMAS.values()) * 2):
                    params = SamplingParams(temperature=0.0, max_tokens=300,
                                            structured_outputs=StructuredOutputsParams(json=schema))
                    engine.add_request(prompts[i % len(prompts)], params)
                    while engine.has_unfinished_requests():
                        tokens += sum(len(o.outputs[0].new_token_ids) for o in engine.step())
                rates.append(tokens / (time.perf_counter() - t0))
        finally:
            DraftMasks.of = of
        key = f"k{k}" + ("" if masked or not k else "_unmasked_drafts")
        result[key] = {"tok_s": statistics.median(rates)}
        if k:
            stats = engine.spec_stats.as_dict()
            result[key].update(acceptance=stats["acceptance_rate"], mean_accept_length=stats["mean_accept_length"])
        print(json.dumps({key: result[key]}), flush=True)
    for key, value in result.items():
        value["speedup"] = value["tok_s"] / result["k0"]["tok_s"]
    return result


def compile_ms(engine, runs: int) -> dict:
    """Each schema's cold compile, median of `runs`, and the vocabulary tables' build."""
    from hybrid_engine.grammar_compiler import GrammarCompiler
    from hybrid_engine.structured_outputs import StructuredOutputsParams

    t0 = time.perf_counter()
    compiler = GrammarCompiler(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    result = {"vocabulary_tables_ms": 1e3 * (time.perf_counter() - t0)}
    for name, schema in SCHEMAS.items():
        samples = []
        for _ in range(runs):
            fresh = GrammarCompiler.__new__(GrammarCompiler)
            fresh.__dict__.update(compiler.__dict__)
            fresh._compiled = type(compiler._compiled)()         # nothing cached
            t0 = time.perf_counter()
            fresh.submit(StructuredOutputsParams(json=schema)).result()
            samples.append(1e3 * (time.perf_counter() - t0))
        result[name] = statistics.median(samples)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("default", "0.8b"), default="default")
    ap.add_argument("--dtype", default=None, help="default: float32 for the default model, bfloat16 for 0.8b")
    ap.add_argument("--work-dir", type=Path, default=Path("/work/llamacpp-work"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--mtp", action="store_true", help="also the MTP rows (constrained, batch 1, k = 0, 2, 4)")
    ap.add_argument("--mask-kernel", choices=("native", "xgrammar"), default="native",
                    help="apply the token masks with our kernel (kernels/sampling) or xgrammar's CPU kernel (A/B)")
    args = ap.parse_args()
    if args.mask_kernel == "xgrammar":
        import xgrammar as xgr

        from hybrid_engine import request_grammar
        request_grammar.apply_token_bitmask = xgr.apply_token_bitmask_inplace

    import torch
    torch.set_num_threads(args.threads)
    from hybrid_engine.kernels.native.isa import detected_level
    dtype = args.dtype or ("float32" if args.model == "default" else "bfloat16")
    batches = [int(b) for b in args.batches.split(",")]
    engine = make_engine(model_folder(args.model, args.work_dir), dtype, max(batches))
    vocab = engine.model_config.vocab_size
    row = {"date": datetime.date.today().isoformat(), "model": args.model, "dtype": dtype, "mask_kernel": args.mask_kernel,
           "threads": args.threads, "cpu_level": detected_level(), "load_start": os.getloadavg()[0]}
    row["compile_ms"] = compile_ms(engine, args.runs)
    print(json.dumps({"compile_ms": row["compile_ms"]}), flush=True)
    for batch in batches:
        for run in range(args.runs):                 # plain and constrained interleaved
            for constrained in (False, True):
                key = f"batch{batch}_{'json' if constrained else 'plain'}_step_ms"
                row.setdefault(key, []).append(steady_step_ms(engine, batch, args.steps, constrained, vocab,
                                                              seed=1000 * run))
        plain = statistics.median(row[f"batch{batch}_plain_step_ms"])
        constrained = statistics.median(row[f"batch{batch}_json_step_ms"])
        row[f"batch{batch}"] = {"plain_ms": plain, "json_ms": constrained, "ratio": constrained / plain}
        print(json.dumps({f"batch{batch}": row[f"batch{batch}"]}), flush=True)
    if args.mtp:
        row["mtp"] = mtp_rows(model_folder(args.model, args.work_dir), dtype, args.runs)
    row["load_end"] = os.getloadavg()[0]
    print(json.dumps(row, indent=1))
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
