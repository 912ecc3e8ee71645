"""`hybrid-engine` console script."""

from __future__ import annotations

import argparse
import sys


def _generate(args) -> int:
    from hybrid_engine import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype)
    prompts = args.prompt or [sys.stdin.read()]
    if llm.tokenizer is None:
        prompts = [[int(t) for t in p.split()] for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for out in llm.generate(prompts, params, use_tqdm=False):
        print(out.text if llm.tokenizer is not None else " ".join(map(str, out.token_ids)))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hybrid-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text from prompts")
    g.add_argument("prompt", nargs="*", help="prompts (text, or space-separated token ids without a tokenizer)")
    g.add_argument("--model", default=None, help="local HF checkpoint folder (default: embedded model)")
    g.add_argument("--dtype", default="auto")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"hybrid-engine: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
