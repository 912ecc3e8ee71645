"""By-hand check of GGUF loading against llama.cpp's own files (not a CI test: it needs the files
llama.cpp's converter and llama-quantize made from one HF folder, and minutes at 0.8B dims).

    python benchmarks/check_gguf.py --folder random-0.8b --gguf-dir gguf/ [--json out.json]

For each file random-0.8b-{f32,bf16,q8_0,q4_0,q4_k_m}.gguf in --gguf-dir (those present):
  f32:  every loaded parameter against the HF folder's, and greedy tokens plus the top-5 logprobs
        of every prompt and generated position against the HF folder's run;
  bf16: the same against the folder loaded in bfloat16;
  q8_0, q4_0, q4_k_m: greedy tokens and logprobs against the plain float run of the same file's
        weights dequantized by gguf.quants.dequantize (no quantized layer: the reference
        shares none of the block reading), both on the torch backend (float activations).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hybrid_engine import EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.checkpoint_formats import gguf as gguf_format

TEXTS = ["def read_config(path):\n", "The capital of France is", "import numpy as np\nx = np.", "Once upon a time,"]
MAX_TOKENS = 32


def _engine(model: str, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, kernel_backend="torch", cache_memory_bytes=256 << 20,
                                  max_num_seqs=4))


def _run(engine: LLMEngine, prompts: list[list[int]]) -> list[dict]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=str(i))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    return [{"tokens": done[i].token_ids, "logprobs": [dict(lp) for lp in done[i].logprobs],
             "prompt_logprobs": [dict(lp) for lp in done[i].prompt_logprobs[1:]]} for i in range(len(prompts))]


def _compare(got: list[dict], want: list[dict]) -> dict:
    """Tokens equal per prompt; the largest logprob difference over the positions both runs share
    (the prompt's and, up to where the greedy tokens part, the generated ones)."""
    worst = 0.0
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g["tokens"], w["tokens"])) if a != b), len(g["tokens"]))
        for a, b in zip(g["prompt_logprobs"] + g["logprobs"][:same + 1], w["prompt_logprobs"] + w["logprobs"][:same + 1]):
            worst = max([worst] + [abs(a[t] - b[t]) for t in a.keys() & b.keys()])
    return {"tokens_equal": [g["tokens"] == w["tokens"] for g, w in zip(got, want)], "max_logprob_diff": worst}


def _max_param_diff(a: LLMEngine, b: LLMEngine) -> tuple[float, str]:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys(), pa.keys() ^ pb.keys()
    return max((float((pa[n].float() - pb[n].float()).abs().max()), n) for n in pa)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", required=True)
    ap.add_argument("--gguf-dir", required=True)
    ap.add_argument("--json")
    args = ap.parse_args()
    stem = Path(args.folder).name
    files = {kind: Path(args.gguf_dir) / f"{stem}-{kind}.gguf" for kind in ("f32", "bf16", "q8_0", "q4_0", "q4_k_m")}
    report = {}
    folder_runs = {}
    for kind, path in files.items():
        if not path.is_file():
            continue
        if kind in ("f32", "bf16"):
            dtype = "float32" if kind == "f32" else "bfloat16"
            ours = _engine(str(path), dtype)
            prompts = [ours.tokenizer.encode(t) for t in TEXTS]
            got = _run(ours, prompts)
            hf = _engine(args.folder, dtype)
            assert [hf.tokenizer.encode(t) for t in TEXTS] == prompts, "the metadata's tokenizer encodes differently"
            diff, where = _max_param_diff(ours, hf)
            folder_runs[kind] = _run(hf, prompts)
            del hf
            report[kind] = {"vs": f"HF folder ({dtype})", "max_param_diff": diff, "at": where,
                            **_compare(got, folder_runs[kind])}
        else:
            ours = _engine(str(path))
            prompts = [ours.tokenizer.encode(t) for t in TEXTS]
            got = _run(ours, prompts)
            del ours
            # the reference: every projection dequantized to float by gguf itself
            original = gguf_format.GgufFile.stored_bits
            gguf_format.GgufFile.stored_bits = lambda self, projection: None
            try:
                reference = _run(_engine(str(path)), prompts)
            finally:
                gguf_format.GgufFile.stored_bits = original
            report[kind] = {"vs": "its weights dequantized by gguf, float", **_compare(got, reference)}
            if "f32" in folder_runs:
                report[kind]["tokens_equal_to_f32_run"] = _compare(got, folder_runs["f32"])["tokens_equal"]
        print(kind, json.dumps(report[kind]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
