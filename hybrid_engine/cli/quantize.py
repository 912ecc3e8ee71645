"""`hybrid-engine quantize SRC DST`: writes a float checkpoint's projections as int8 / int4 in
compressed-tensors' pack-quantized format (hybrid_engine/quantize_checkpoint.py), so a model is
quantized once and loads quantized from then on (here, and in vLLM); with `--plan auto`, each
kind of projection at the precision its measured sensitivity earns within a byte budget."""

from __future__ import annotations

import re
from pathlib import Path

from . import CLIError, console

NAME = "quantize"
HELP = "write a float checkpoint as an int8 / int4 (or mixed, --plan auto) compressed-tensors checkpoint"
DESCRIPTION = """\
Quantizes the projections online quantization (--quantization) quantizes, with the same rule and
values: int8 or int4 in groups of --group-size input columns, one float16 scale per group
(llama.cpp's Q8_0 / Q4_0 rules); MoE experts each on its own, written per expert. GDN's
in_proj_b / in_proj_a, mtp.fc, the MoE router and shared-expert gate, norms, convolutions and
embeddings (and a tied lm_head) stay as stored. The copy loads with `--model DST` and no
--quantization.

--plan auto --max-bytes B mixes precisions instead: it measures each kind of projection's
sensitivity (the mean KL divergence of the next-token distributions on --calibration text
when that kind alone is quantized, at int4 and at int8; one float run, then two per kind),
chooses each kind's int4, int8 or float to minimise the summed KL within B bytes of tensors
(as the written checkpoint holds them), prints the plan and writes it, the plan kept in its
config.json as "quantization_plan". B takes suffixes: 400MB, 1.5GB (powers of 1000), 2GiB.

  hybrid-engine quantize ./Qwen3.5-0.8B ./Qwen3.5-0.8B-int4 --method int4
  hybrid-engine quantize ./Qwen3.5-9B ./Qwen3.5-9B-int8 --method int8 --group-size 128
  hybrid-engine quantize ./Qwen3.5-0.8B ./Qwen3.5-0.8B-mixed --plan auto --max-bytes 700MB
"""

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="float checkpoint folder (config.json + safetensors)")
    parser.add_argument("dst", metavar="DST", help="folder to write (new, or empty)")
    parser.add_argument("--method", choices=("int8", "int4"), default=None, help="bits per weight")
    parser.add_argument("--group-size", type=int, default=None, metavar="N",
                        help="input columns per scale, a multiple of 32 (default: 32)")
    parser.add_argument("--plan", choices=("auto",), default=None,
                        help="mix int4 / int8 / float per kind of projection by measured sensitivity")
    parser.add_argument("--max-bytes", type=parse_bytes, default=None, metavar="B",
                        help="--plan's budget for all tensors: bytes, or with a suffix (400MB, 1.5GB, 2GiB)")
    parser.add_argument("--calibration", default=None, metavar="FILE",
                        help="--plan's calibration text (default: Python's own argparse.py)")
    parser.add_argument("--calibration-windows", type=int, default=None, metavar="N",
                        help="windows of the calibration text to score (default: 4)")
    parser.add_argument("--calibration-ctx", type=int, default=None, metavar="N",
                        help="tokens per calibration window, its second half scored (default: 256)")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if m is None or m[2].lower() not in UNITS:
        raise CLIError(f"--max-bytes {text!r} is not a size (bytes, or a number with KB, MB, GB, TB, KiB, MiB, "
                       "GiB or TiB)")
    return int(float(m[1]) * UNITS[m[2].lower()])


def run(args) -> int:
    from tqdm import tqdm

    from ..models.config import CheckpointError, ConfigError
    from ..quantization import parse_quantization

    if not Path(args.src).is_dir():
        raise CLIError(f"model folder not found: {args.src}")
    _check_flags(args)
    try:
        scheme = parse_quantization(args.method or "int4", args.group_size)
        if scheme.group_size % 32:
            raise ValueError(f"--group-size {scheme.group_size} is not a multiple of 32")
        progress = lambda keys: tqdm(keys, desc="writing", unit="tensor", leave=False, disable=None)  # noqa: E731
        if args.plan:
            return _run_plan(args, scheme.group_size, progress)
        from ..quantize_checkpoint import write_quantized
        done = write_quantized(args.src, args.dst, scheme, progress)
    except (ValueError, FileExistsError, CheckpointError, ConfigError) as e:
        raise CLIError(str(e)) from None
    console().print(f"wrote {args.dst}: {len(done)} projections as {args.method} in groups of {scheme.group_size}")
    return 0


def _check_flags(args) -> None:
    plan_flags = [f for f, v in (("--max-bytes", args.max_bytes), ("--calibration", args.calibration),
                                 ("--calibration-windows", args.calibration_windows),
                                 ("--calibration-ctx", args.calibration_ctx)) if v is not None]
    if args.plan is None:
        if args.method is None:
            raise CLIError("give --method int8 | int4, or --plan auto --max-bytes B")
        if plan_flags:
            raise CLIError(f"{plan_flags[0]} goes with --plan auto")
        return
    if args.method is not None:
        raise CLIError("give --method or --plan, not both")
    if args.max_bytes is None:
        raise CLIError("--plan auto needs --max-bytes B")
    for flag, value, least in (("--calibration-windows", args.calibration_windows, 1),
                               ("--calibration-ctx", args.calibration_ctx, 4)):
        if value is not None and value < least:
            raise CLIError(f"{flag} must be at least {least}, got {value}")


def _run_plan(args, group_size: int, progress) -> int:
    import sys

    from ..quantize_checkpoint import write_planned
    from ..sensitivity import DEFAULT_CTX, DEFAULT_WINDOWS, calibration_windows, default_calibration
    from ..tokenizer import load_tokenizer

    if args.calibration is None:
        text, source = default_calibration()
    else:
        try:
            text, source = Path(args.calibration).read_text(encoding="utf-8"), args.calibration
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"cannot read --calibration {args.calibration}: {e}") from None
    tokenizer = load_tokenizer(args.src)
    if tokenizer is None:
        raise CLIError(f"--plan auto tokenizes its calibration text, and {args.src} has no tokenizer")
    ctx, count = args.calibration_ctx or DEFAULT_CTX, args.calibration_windows or DEFAULT_WINDOWS
    windows = calibration_windows(tokenizer.encode(text, add_special_tokens=False), ctx, count)
    print(f"measuring: {len(windows)} windows of {ctx} tokens of {source}", file=sys.stderr)
    on_run = lambda kind, bits, kl: print(f"  {kind} int{bits}: KL {kl:.6f}", file=sys.stderr)  # noqa: E731
    plan = write_planned(args.src, args.dst, args.max_bytes, windows, source, group_size, progress, on_run)
    console().print(plan_table(plan))
    kl = sum(row[f"kl_int{row['bits']}"] for row in plan["kinds"].values() if row["bits"] is not None)
    console().print(f"wrote {args.dst}: {plan['total_bytes']:,} bytes of tensors (--max-bytes {plan['max_bytes']:,}; "
                    f"{plan['fixed_bytes']:,} of them kept as stored in every plan), summed KL {kl:.6f}")
    return 0


def plan_table(plan: dict):
    from rich.table import Table

    table = Table(title=f"plan: mean KL on {plan['windows']} windows of {plan['ctx_size']} tokens, "
                        f"groups of {plan['group_size']}")
    for column in ("kind", "weights", "KL int4", "KL int8", "chosen", "bytes"):
        table.add_column(column, justify="left" if column in ("kind", "chosen") else "right")
    for kind, row in plan["kinds"].items():
        chosen = "float" if row["bits"] is None else f"int{row['bits']}"
        table.add_row(kind, str(row["weights"]), f"{row['kl_int4']:.6f}", f"{row['kl_int8']:.6f}", chosen,
                      f"{row['bytes']:,}")
    return table
