"""`hybrid-engine generate`: complete prompts from arguments, a file or stdin."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from . import (CLIError, add_engine_arguments, add_prompt_arguments, add_sampling_arguments, build_llm,
                  encode_prompts, read_prompts, sampling_params)

NAME = "generate"
HELP = "generate text from prompts"
DESCRIPTION = """\
Complete prompts: from the arguments, from --file (one per line, or JSONL with "prompt"),
or all of stdin as one prompt. A JSONL line may also set sampling fields (SamplingParams'
names: "max_tokens", "temperature", "stop", ...), which override the flags for that prompt.
A single prompt streams to the terminal as it is generated.
Without a tokenizer in the model folder, a prompt is space-separated token ids.

  hybrid-engine generate "def fibonacci(n):" --max-tokens 48
  hybrid-engine generate --file prompts.jsonl --temperature 0.8 --seed 0 --json
  echo "class Stack:" | hybrid-engine generate --speculative-tokens 2
  hybrid-engine generate "# a user" --json-schema user.schema.json --max-tokens 200
"""


# What a --file JSONL line may set besides "prompt": any SamplingParams field (vLLM's names).
LINE_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
               "frequency_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids",
               "ignore_eos", "logprobs")


def add_arguments(parser) -> None:
    add_prompt_arguments(parser)
    add_sampling_arguments(parser, max_tokens=64, model_defaults=True)
    add_engine_arguments(parser)
    parser.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                        help="MTP speculative decoding with K draft tokens (default: off)")
    parser.add_argument("--no-stream", dest="stream", action="store_false",
                        help="print each completion when it is done (default for several prompts)")
    parser.add_argument("--echo", action="store_true", help="print the prompt before its completion")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per prompt on stdout (text, token ids, finish reason, metrics)")
    g = parser.add_argument_group("structured outputs (one of them; SamplingParams.structured_outputs)")
    g.add_argument("--json-schema", default=None, metavar="FILE|JSON", help="a JSON schema, inline or a file")
    g.add_argument("--json-object", action="store_true", default=None, help="any JSON object")
    g.add_argument("--regex", default=None, metavar="REGEX")
    g.add_argument("--choice", action="append", default=None, metavar="STRING", help="one of these (repeatable)")
    g.add_argument("--grammar", default=None, metavar="FILE|EBNF", help="an EBNF grammar (xgrammar's), inline or a file")


def run(args) -> int:
    params = sampling_params(args)
    params.structured_outputs = structured_outputs(args)
    prompts, line_fields = read_prompts(args, line_fields=LINE_FIELDS)
    per_prompt = [_line_params(params, fields, i) for i, fields in enumerate(line_fields)]
    llm = build_llm(args, args.speculative_tokens)
    prompts = encode_prompts(llm, prompts)
    if any(line_fields):
        params = per_prompt
    start = time.perf_counter()
    if args.stream and len(prompts) == 1 and not args.json:
        outputs = [_stream(llm, prompts[0], params, args.echo)]
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for i, out in enumerate(outputs):
            _print_output(llm, i, out, len(prompts), args)
    _summary(outputs, time.perf_counter() - start, args.speculative_tokens)
    return 0


def structured_outputs(args):
    """The --json-schema / --json-object / --regex / --choice / --grammar flag as
    StructuredOutputsParams (None without one), checked before any model loads."""
    from ..structured_outputs import StructuredOutputsParams

    given = {"json": _inline_or_file(args.json_schema), "json_object": args.json_object, "regex": args.regex,
             "choice": args.choice, "grammar": _inline_or_file(args.grammar)}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    flags = {"json": "--json-schema", "json_object": "--json-object", "regex": "--regex", "choice": "--choice",
             "grammar": "--grammar"}
    if len(given) > 1:
        raise CLIError(f"give one of {', '.join(flags[k] for k in given)}, not several")
    params = StructuredOutputsParams(**given)
    try:
        params.validate()
    except ValueError as e:
        raise CLIError(f"{flags[next(iter(given))]}: {e}") from None
    return params


def _inline_or_file(value: str | None) -> str | None:
    """A flag that takes text or the path of a file holding it."""
    if value is None or not Path(value).is_file():
        return value
    return Path(value).read_text()


def _line_params(params, fields: dict, index: int):
    """The command line's sampling params with what prompt `index`'s JSONL line sets."""
    if not fields:
        return params
    line = dataclasses.replace(params, **fields)
    try:
        line.validate(vocab_size=2**31)   # token ids are checked against the vocabulary later
    except ValueError as e:
        raise CLIError(f"prompt {index} of --file: {e}") from None
    return line


def _as_text(llm, token_ids: list[int], text: str) -> str:
    return text if llm.tokenizer is not None else " ".join(map(str, token_ids))


def _stream(llm, prompt, params, echo: bool):
    out = sys.stdout
    if echo:
        out.write(prompt if isinstance(prompt, str) else " ".join(map(str, prompt)) + " ")
    last = None
    for last in llm.generate_stream(prompt, params):
        delta = last.new_text if llm.tokenizer is not None else "".join(f"{t} " for t in last.new_token_ids)
        out.write(delta)
        out.flush()
    out.write("\n")
    return last


def _print_output(llm, i: int, out, num_prompts: int, args) -> None:
    text = _as_text(llm, out.token_ids, out.text)
    if args.json:
        record = {"index": i, "prompt": out.prompt if out.prompt is not None else out.prompt_token_ids,
                  "text": text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                  "metrics": out.metrics}
        print(json.dumps(record))
        return
    if num_prompts > 1:
        print(f"--- [{i}] {out.finish_reason}, {len(out.token_ids)} tokens ---")
    prompt = out.prompt if out.prompt is not None else " ".join(map(str, out.prompt_token_ids)) + " "
    print((prompt if args.echo else "") + text)


def _summary(outputs, seconds: float, k: int) -> None:
    """One line on stderr, so that stdout holds only the completions."""
    n = sum(len(o.token_ids) for o in outputs)
    line = f"[{len(outputs)} prompt(s), {n} tokens in {seconds:.2f} s, {n / max(seconds, 1e-9):.1f} tok/s"
    if k:
        steps = sum(o.metrics["spec_decode"]["num_verify_steps"] for o in outputs)
        accepted = sum(o.metrics["spec_decode"]["num_accepted"] for o in outputs)
        line += f"; MTP k={k}: mean accept length {1 + accepted / steps:.2f}" if steps else f"; MTP k={k}"
    print(line + "]", file=sys.stderr)
