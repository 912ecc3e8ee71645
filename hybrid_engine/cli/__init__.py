"""`hybrid-engine` console script: generate, bench, inspect (and `inspect diff`), serve, perplexity,
quantize.

Each command is a module of this package (generate.py, bench.py, inspect.py with
inspect_prefix.py, serve.py, perplexity.py, quantize.py: NAME, HELP, DESCRIPTION, add_arguments, run); this
file holds what they share: the parser, the engine and prompt options,
and the one rule for errors: a user's mistake (a bad flag value, a missing model folder, a
bad prompt, an unreadable snapshot, speculation without an MTP head) is one line on stderr,
`hybrid-engine: error: ...`, and exit code 2. A bug still shows its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PROG = "hybrid-engine"


class CLIError(Exception):
    """A mistake on the command line: reported in one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the usage block and exit by itself
        raise CLIError(f"{message} (see '{self.prog} --help')")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # numpy before torch: torch's C extension imports numpy itself and takes any failure,
        # a KeyboardInterrupt included, as "numpy is missing", so a Ctrl-C landing there
        # would be swallowed and the run would go on.
        import numpy  # noqa: F401
        args = _parse(argv)
        return args.run(args)
    except BrokenPipeError:  # `hybrid-engine ... | head`: the reader left; not an error
        sys.stdout = open(os.devnull, "w")
        return 0
    except (CLIError, ValueError, OSError) as e:
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130


def _parse(argv: list[str]) -> argparse.Namespace:
    from . import bench, generate, inspect, perplexity, quantize, serve

    # `inspect diff A B` has its own positionals; `inspect [PROMPT ...]` takes prompts.
    if argv[:2] == ["inspect", "diff"]:
        parser = _Parser(prog=f"{PROG} inspect diff", description=inspect.DIFF_DESCRIPTION)
        inspect.add_diff_arguments(parser)
        args = parser.parse_args(argv[2:])
        args.run = inspect.run_diff
        return args
    parser = _Parser(prog=PROG, description="Inference engine for Qwen3.5-style hybrid LMs.",
                     epilog="`hybrid-engine inspect diff A B` compares two snapshots. "
                            "`hybrid-engine COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for module in (generate, bench, inspect, serve, perplexity, quantize):
        p = sub.add_parser(module.NAME, help=module.HELP, description=module.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser.parse_args(argv)


# ---- options shared by the commands ----------------------------------------------------------

def add_engine_arguments(parser: argparse.ArgumentParser, dtype_default: str | None = "auto",
                         dtype_help: str = "weight dtype (default: auto: the config's, else float32)") -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local HF checkpoint folder or GGUF file (default: the embedded model)")
    g.add_argument("--dtype", default=dtype_default, choices=["auto", "float32", "bfloat16", "float16"],
                   help=dtype_help)
    g.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    g.add_argument("--block-size", type=int, default=16, help="KV block size in tokens (default: 16)")
    g.add_argument("--max-num-seqs", type=int, default=16,
                   help="most requests running at once (default: 16)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached prompt prefixes between requests (KV blocks and GDN checkpoints; "
                        "default: on, as in vLLM)")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile decode/verify steps and MTP drafting: faster steps after "
                        "tens of seconds of compiling at the first steps (CPU)")
    g.add_argument("--kernel-backend", choices=("auto", "torch", "cpu", "triton"), default="auto",
                   help="the kernels' backend: torch (the reference), cpu (native kernels), triton (GPU); "
                        "default auto: triton on CUDA, cpu where its kernels build, else torch")
    g.add_argument("--quantization", choices=("int8", "int4"), default=None,
                   help="quantize a float checkpoint's projections at load (weights only; default: none)")
    g.add_argument("--quantization-group-size", type=int, default=None, metavar="N",
                   help="input columns per quantization scale (default: 32)")
    g.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="run the model over N processes on this machine, each holding 1/N of its heads "
                        "(CPU, gloo; default: 1)")


def add_prompt_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", metavar="PROMPT",
                        help="prompt text (space-separated token ids when the model has no tokenizer)")
    parser.add_argument("--file", default=None, metavar="FILE",
                        help="prompts, one per line, or JSONL with a \"prompt\" field ('-' = stdin)")


def build_llm(args, num_speculative_tokens: int = 0, dtype: str | None = None):
    from .. import LLM

    return LLM(**engine_arguments(args, num_speculative_tokens, dtype))


def build_engine(args, num_speculative_tokens: int = 0, dtype: str | None = None):
    """An LLMEngine with build_llm's settings, for stepping on the caller's thread (no loop thread)."""
    from ..config import EngineConfig
    from ..engine import LLMEngine

    return LLMEngine(EngineConfig(**engine_arguments(args, num_speculative_tokens, dtype)))


def engine_arguments(args, num_speculative_tokens: int = 0, dtype: str | None = None) -> dict:
    """The engine flags, checked, as LLM's (and EngineConfig's) keyword arguments: the one place
    every command's engine is configured from its flags (add_engine_arguments)."""
    import torch

    if args.model is not None and not Path(args.model).is_dir() and not Path(args.model).is_file():
        raise CLIError(f"model folder not found: {args.model} (nor a GGUF file)")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        raise CLIError(f"--device {args.device!r} is not a torch device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {args.device} but torch sees no CUDA device")
    if num_speculative_tokens < 0:
        raise CLIError(f"--speculative-tokens must be >= 0, got {num_speculative_tokens}")
    spec = {"method": "mtp", "num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else None
    seqs = args.max_num_seqs
    return dict(model=args.model, dtype=dtype or args.dtype, device=args.device, block_size=args.block_size,
                max_num_seqs=seqs, max_num_batched_tokens=max(2048, seqs * (1 + num_speculative_tokens)),
                speculative_config=spec, enable_torch_compile=getattr(args, "torch_compile", False),
                cache_memory_bytes=getattr(args, "cache_memory_bytes", None),
                enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
                kernel_backend=getattr(args, "kernel_backend", "auto"),
                quantization=getattr(args, "quantization", None),
                quantization_group_size=getattr(args, "quantization_group_size", None),
                tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))


def read_prompts(args, stdin_fallback: bool = True, line_fields: tuple[str, ...] = ()
                 ) -> tuple[list[str | list[int]], list[dict]]:
    """Prompts from the arguments, else --file, else (when allowed) all of stdin as one prompt;
    with each prompt, the fields of `line_fields` its JSONL line sets (empty otherwise)."""
    if args.prompts and args.file:
        raise CLIError("give prompts as arguments or with --file, not both")
    if args.prompts:
        prompts = list(args.prompts)
    elif args.file:
        return read_prompt_file(args.file, line_fields)
    elif stdin_fallback and not sys.stdin.isatty() and (text := sys.stdin.read()).strip():
        prompts = [text.rstrip("\n")]
    elif stdin_fallback:
        raise CLIError("no prompt given: pass it as an argument, with --file, or on stdin")
    else:
        prompts = []
    return prompts, [{} for _ in prompts]


def read_prompt_file(path: str, line_fields: tuple[str, ...] = ()) -> tuple[list[str | list[int]], list[dict]]:
    """One prompt per line, or JSONL objects with "prompt" (a string or a list of token ids) and
    any of `line_fields`; another field is refused, not silently ignored. -> (prompts, the
    fields each line set)."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CLIError(f"prompt file not found: {path}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read prompt file {path}: {e}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise CLIError(f"prompt file {path} holds no prompts")
    if not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines], [{} for _ in lines]
    prompts, fields = [], []
    for n, line in lines:
        try:
            record = json.loads(line)
            prompts.append(record.pop("prompt"))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CLIError(f"{path} line {n}: expected a JSON object with a \"prompt\" field") from None
        unknown = sorted(set(record) - set(line_fields))
        if unknown:
            allowed = f"\"prompt\" and {', '.join(line_fields)}" if line_fields else "only \"prompt\""
            raise CLIError(f"{path} line {n}: unknown field(s) {', '.join(map(repr, unknown))}; "
                           f"a line holds {allowed}")
        fields.append(record)
    return prompts, fields


def encode_prompts(llm, prompts: list[str | list[int]]) -> list[str | list[int]]:
    """Text prompts become token ids when the model has no tokenizer; every prompt is then
    checked by the engine, so a bad one fails before anything runs."""
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str) and llm.tokenizer is None:
            try:
                p = [int(t) for t in p.split()]
            except ValueError:
                raise CLIError(f"prompt {i}: the model has no tokenizer, so a prompt must be "
                               f"space-separated token ids; got {p[:40]!r}") from None
        try:
            llm.engine.encode_prompt(p)
        except ValueError as e:
            raise CLIError(f"prompt {i}: {e}") from None
        out.append(p)
    return out


def sampling_params(args, **fixed):
    """SamplingParams from the sampling flags present on `args`, checked before any model loads;
    a bad value is reported under its flag's name."""
    from ..sampling_params import SamplingParams

    names = ("temperature", "top_k", "top_p", "min_p", "max_tokens", "seed", "stop",
             "repetition_penalty", "ignore_eos")
    given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    given.update(fixed)
    values = dict(args.builtin_sampling)
    if args.model_sampling_defaults:
        from ..default_model import default_model_path
        from ..generation_defaults import FILE_NAME, describe, load_generation_defaults

        folder = args.model or default_model_path()
        try:
            from_model = load_generation_defaults(folder)
        except ValueError as e:
            raise CLIError(str(e)) from None
        used = {k: v for k, v in from_model.items() if k not in given}
        if used:
            print(f"[sampling defaults from {Path(folder) / FILE_NAME}: {describe(used)}; "
                  "flags override them]", file=sys.stderr)
        values.update(used)
    values.update(given)
    params = SamplingParams(**values)
    try:
        params.validate(vocab_size=2**31)   # no vocabulary-dependent field comes from the command line
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise CLIError(f"--{field.replace('_', '-')} {str(e).split(' ', 1)[1]}") from None
    return params


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int, full: bool = True,
                           model_defaults: bool = False) -> None:
    """model_defaults: flags left out take the model folder's generation_config.json values
    (then the defaults below); the flags' defaults are None so that given ones are known."""
    where = "the model's generation_config.json, else " if model_defaults else ""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=None, help=f"tokens to generate (default: {where}{max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help=f"0 = greedy (default: {where}0)")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--ignore-eos", action="store_true", default=None,
                   help="keep generating past the end-of-sequence token")
    parser.set_defaults(builtin_sampling={"max_tokens": max_tokens, "temperature": 0.0},
                        model_sampling_defaults=model_defaults)
    if full:
        g.add_argument("--top-k", type=int, default=None, help=f"-1 = the whole vocabulary (default: {where}-1)")
        g.add_argument("--top-p", type=float, default=None, help=f"(default: {where}1.0)")
        g.add_argument("--min-p", type=float, default=None, help=f"(default: {where}0.0)")
        g.add_argument("--repetition-penalty", type=float, default=None, help=f"(default: {where}1.0)")
        g.add_argument("--stop", action="append", default=None, metavar="STRING",
                       help="stop at this string (repeatable)")


def console(file=None):
    """A rich console; when not writing to a terminal, wide enough that tables do not wrap."""
    from rich.console import Console

    file = file or sys.stdout
    return Console(file=file, width=None if file.isatty() else 200, highlight=False)


def dtype_name(engine) -> str:
    return str(engine.model.embed_tokens.weight.dtype).removeprefix("torch.")


def check_output_path(flag: str, path: str | None, stdout_ok: bool = False) -> None:
    """Before anything runs: an output file that cannot be written would lose the whole run
    (a benchmark, a snapshot), and the OSError at the end would not name the flag."""
    if path is None or (stdout_ok and path == "-"):
        return
    target = Path(path)
    if target.is_dir():
        raise CLIError(f"{flag} {path} is a folder; give a file name")
    folder = target.parent
    if not folder.is_dir():
        raise CLIError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CLIError(f"{flag} {path}: not writable")


def write_json(path: str, data) -> None:
    text = json.dumps(data, indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")

