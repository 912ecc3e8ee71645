"""`hybrid-engine perplexity`: llama-perplexity's measurement (hybrid_engine/perplexity.py) and
its KL divergence against a base run (hybrid_engine/kl_divergence.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from . import CLIError, add_engine_arguments, build_llm, check_output_path, dtype_name, write_json

NAME = "perplexity"
HELP = "perplexity of a text file (llama-perplexity's method), and KL divergence against a base run"
DESCRIPTION = """\
Tokenizes the whole file, cuts it into windows of --ctx-size tokens and scores the second
half of each window, every token predicted from the tokens before it in its window, as
llama-perplexity does (so the figures compare with its); prints PPL = exp(mean NLL) +/- its
standard error. Scoring uses SamplingParams(prompt_logprobs=...): the engine's own path.

--save-kl-base FILE keeps this run's distributions at the scored tokens (each one's --kl-top-k
most likely tokens; safetensors, (k + 1) x 8 bytes per token); a run of the same text with
--kl-base FILE (another --dtype, a quantized model) then prints the mean KL divergence from
that base and how often both rank the same token first. The KL is taken over the tokens both
runs list plus one bucket for the rest: a lower bound of the full KL, tight when the base's
mass outside them, printed beside it, is small (hybrid_engine/kl_divergence.py).

  hybrid-engine perplexity held_out.py
  hybrid-engine perplexity wiki.test.raw --model ./Qwen3.5-0.8B --dtype float32 --save-kl-base base.st
  hybrid-engine perplexity wiki.test.raw --model ./Qwen3.5-0.8B --dtype bfloat16 --kl-base base.st
"""


def add_arguments(parser) -> None:
    parser.add_argument("file", metavar="FILE", help="the text to score ('-' = stdin)")
    parser.add_argument("--ctx-size", type=int, default=512, metavar="N",
                        help="window length in tokens; its second half is scored (default: 512, llama-perplexity's)")
    parser.add_argument("--max-windows", type=int, default=None, metavar="N",
                        help="score at most the first N windows (default: every whole window of the file)")
    parser.add_argument("--batch", type=int, default=4, metavar="N",
                        help="windows sent to the engine together (default: 4, llama-perplexity's 2048-token batch "
                             "at --ctx-size 512)")
    parser.add_argument("--save-kl-base", default=None, metavar="OUT",
                        help="write this run's distributions at the scored tokens, for a later --kl-base")
    parser.add_argument("--kl-base", default=None, metavar="FILE",
                        help="a --save-kl-base file of the same text: print the KL divergence from it")
    parser.add_argument("--kl-top-k", type=int, default=64, metavar="K",
                        help="tokens kept per position by --save-kl-base (default: 64)")
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON ('-' = stdout)")
    add_engine_arguments(parser)


def run(args) -> int:
    from ..kl_divergence import load_kl_base
    from ..perplexity import scored_token_ids, split_windows

    _check_flags(args)
    text = _read_text(args.file)
    base = None
    if args.kl_base is not None:
        base = load_kl_base(args.kl_base)
        if base.ctx_size != args.ctx_size:
            raise CLIError(f"--kl-base {args.kl_base} was made with --ctx-size {base.ctx_size}, not {args.ctx_size}")
    llm = build_llm(args)
    if llm.tokenizer is None:
        raise CLIError("perplexity needs a tokenizer; the model folder has none")
    if args.ctx_size >= llm.engine.max_model_len:
        raise CLIError(f"--ctx-size {args.ctx_size} does not fit the model's context ({llm.engine.max_model_len} "
                       "tokens, one of them for the token each window generates)")
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)
    windows = split_windows(tokens, args.ctx_size, args.max_windows)
    if not windows:
        raise CLIError(f"{args.file} has {len(tokens)} tokens, fewer than one window of --ctx-size {args.ctx_size}")
    if base is not None and base.scored.token_ids.tolist() != scored_token_ids(windows):
        raise CLIError(f"--kl-base {args.kl_base} scored other tokens (another text, tokenizer or --max-windows)")
    top_k = base.top_k if base is not None else args.kl_top_k if args.save_kl_base else 0
    results = _measure(args, llm, windows, top_k, base)
    if args.json:
        write_json(args.json, results)
    return 0


def _check_flags(args) -> None:
    if args.ctx_size < 4:
        raise CLIError(f"--ctx-size must be at least 4 (its second half is scored), got {args.ctx_size}")
    for flag, value in (("--max-windows", args.max_windows), ("--batch", args.batch)):
        if value is not None and value < 1:
            raise CLIError(f"{flag} must be >= 1, got {value}")
    if args.save_kl_base is not None and args.kl_top_k < 1:
        raise CLIError(f"--kl-top-k must be >= 1, got {args.kl_top_k}")
    if args.save_kl_base is not None and args.kl_base is not None:
        raise CLIError("give --save-kl-base (write a base) or --kl-base (compare with one), not both")
    check_output_path("--save-kl-base", args.save_kl_base)
    check_output_path("--json", args.json, stdout_ok=True)


def _read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CLIError(f"file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CLIError(f"cannot read {path}: {e}") from None


def _measure(args, llm, windows, top_k: int, base) -> dict:
    """Scores the windows, printing llama-perplexity's running estimate per window on stderr,
    then the results on stdout."""
    import torch

    from ..kl_divergence import kl_divergence, save_kl_base
    from ..perplexity import perplexity, score_windows

    nlls = []

    def progress(i: int, window_nll) -> None:
        nlls.append(window_nll)
        print(f"[{i + 1}]{torch.cat(nlls).mean().exp().item():.4f},", end="", file=sys.stderr, flush=True)
    print(f"perplexity: {len(windows)} windows of {args.ctx_size} tokens", file=sys.stderr)
    scored = score_windows(llm, windows, top_k, args.batch, progress)
    print(file=sys.stderr)
    ppl, error = perplexity(scored.logprobs)
    results = {"ppl": ppl, "ppl_error": error, "nll": -scored.logprobs.mean().item(),
               "tokens_scored": scored.token_ids.numel(), "windows": len(windows), "ctx_size": args.ctx_size,
               "model": args.model or "default", "dtype": dtype_name(llm.engine)}
    print(f"PPL = {ppl:.4f} +/- {error:.5f}  ({results['tokens_scored']} tokens scored in "
          f"{len(windows)} windows of {args.ctx_size})")
    if args.save_kl_base is not None:
        save_kl_base(args.save_kl_base, scored, args.ctx_size, top_k, model=results["model"], dtype=results["dtype"])
        print(f"KL base written to {args.save_kl_base} (top {top_k} per scored token)")
    if base is not None:
        kl = kl_divergence(base.scored, scored)
        base_ppl, base_error = perplexity(base.scored.logprobs)
        results.update(kl=kl.kl[0], kl_error=kl.kl[1], same_top=kl.same_top[0], same_top_error=kl.same_top[1],
                       base_mass_outside=kl.base_mass_outside, base_ppl=base_ppl, kl_top_k=top_k)
        print(f"PPL(base) = {base_ppl:.4f} +/- {base_error:.5f}  ({base.metadata.get('model')}, "
              f"{base.metadata.get('dtype')})")
        print(f"Mean KLD = {kl.kl[0]:.6f} +/- {kl.kl[1]:.6f}  (over each run's top {top_k} and the rest; "
              f"the base's mass outside them: {100 * kl.base_mass_outside:.2f}%)")
        print(f"Same top = {100 * kl.same_top[0]:.3f} +/- {100 * kl.same_top[1]:.3f} %")
    return results
