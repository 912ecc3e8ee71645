"""`hybrid-engine quantize SRC DST`: writes a float checkpoint's projections as int8 / int4 in
compressed-tensors' pack-quantized format (hybrid_engine/quantize_checkpoint.py), so a model is
quantized once and loads quantized from then on (here, and in vLLM)."""

from __future__ import annotations

from pathlib import Path

from . import CLIError, console

NAME = "quantize"
HELP = "write a float checkpoint as an int8 / int4 compressed-tensors checkpoint"
DESCRIPTION = """\
Quantizes the projections online quantization (--quantization) quantizes, with the same rule and
values: int8 or int4 in groups of --group-size input columns, one float16 scale per group
(llama.cpp's Q8_0 / Q4_0 rules); MoE experts each on its own, written per expert. GDN's
in_proj_b / in_proj_a, mtp.fc, the MoE router and shared-expert gate, norms, convolutions and
embeddings (and a tied lm_head) stay as stored. The copy loads with `--model DST` and no
--quantization.

  hybrid-engine quantize ./Qwen3.5-0.8B ./Qwen3.5-0.8B-int4 --method int4
  hybrid-engine quantize ./Qwen3.5-9B ./Qwen3.5-9B-int8 --method int8 --group-size 128
"""


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="float checkpoint folder (config.json + safetensors)")
    parser.add_argument("dst", metavar="DST", help="folder to write (new, or empty)")
    parser.add_argument("--method", choices=("int8", "int4"), required=True, help="bits per weight")
    parser.add_argument("--group-size", type=int, default=None, metavar="N",
                        help="input columns per scale, a multiple of 32 (default: 32)")


def run(args) -> int:
    from tqdm import tqdm

    from ..models.config import CheckpointError, ConfigError
    from ..quantization import parse_quantization
    from ..quantize_checkpoint import write_quantized

    if not Path(args.src).is_dir():
        raise CLIError(f"model folder not found: {args.src}")
    try:
        scheme = parse_quantization(args.method, args.group_size)
        if scheme.group_size % 32:
            raise ValueError(f"--group-size {scheme.group_size} is not a multiple of 32")
        done = write_quantized(args.src, args.dst, scheme,
                               progress=lambda keys: tqdm(keys, desc=f"quantizing to {args.method}",
                                                          unit="tensor", leave=False, disable=None))
    except (ValueError, FileExistsError, CheckpointError, ConfigError) as e:
        raise CLIError(str(e)) from None
    console().print(f"wrote {args.dst}: {len(done)} projections as {args.method} in groups of {scheme.group_size}")
    return 0
