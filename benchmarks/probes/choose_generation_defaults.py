"""Chooses the embedded default model's generation_config.json by measurement (issue 17 item 18).

For each setting of (temperature, top_p, repetition_penalty), every built-in bench prompt is
completed with 64 tokens under 3 seeds, and two numbers are reported:
- repetition: the share of 4-grams of a completion's tokens that repeat an earlier 4-gram of the
  same completion (the greedy loop ` # 1000000000...` scores near 1);
- logprob: the mean log-probability the model gives the tokens it emitted (its own confidence:
  high temperatures emit tokens the model itself finds unlikely, i.e. less readable code).
A quality measurement, not a timing one: the numbers do not depend on the machine's load.

    python benchmarks/probes/choose_generation_defaults.py [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

from hybrid_engine import LLM, SamplingParams
from hybrid_engine.cli.bench import BUILTIN_PROMPTS

TEMPERATURES = (0.0, 0.6, 0.8)
TOP_PS = (0.9, 1.0)
REPETITION_PENALTIES = (1.0, 1.1, 1.2, 1.3)
SEEDS = (0, 1, 2)
MAX_TOKENS = 64
N = 4


def repetition(token_ids: list[int], n: int = N) -> float:
    grams = [tuple(token_ids[i:i + n]) for i in range(len(token_ids) - n + 1)]
    return 0.0 if not grams else 1 - len(set(grams)) / len(grams)


def settings():
    for t, p, r in itertools.product(TEMPERATURES, TOP_PS, REPETITION_PENALTIES):
        if t == 0.0 and p != 1.0:
            continue   # top_p changes nothing when greedy
        yield t, p, r


def measure(llm: LLM, temperature: float, top_p: float, penalty: float) -> dict:
    params = [SamplingParams(temperature=temperature, top_p=top_p, repetition_penalty=penalty,
                             max_tokens=MAX_TOKENS, seed=seed, logprobs=0)
              for _ in BUILTIN_PROMPTS for seed in SEEDS]
    prompts = [p for p in BUILTIN_PROMPTS for _ in SEEDS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    logprobs = [lp[t] for o in outs for t, lp in zip(o.token_ids, o.logprobs)]
    return {"temperature": temperature, "top_p": top_p, "repetition_penalty": penalty,
            "repetition": sum(repetition(o.token_ids) for o in outs) / len(outs),
            "logprob": sum(logprobs) / len(logprobs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    llm = LLM(dtype="float32", generation_config="vllm")   # the embedded model, none of its defaults
    rows = [measure(llm, *s) for s in settings()]
    print("| temperature | top_p | repetition_penalty | repetition (4-grams) | mean logprob |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['temperature']} | {r['top_p']} | {r['repetition_penalty']} | {r['repetition']:.3f} "
              f"| {r['logprob']:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
