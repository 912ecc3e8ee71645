"""Each tensor kind's sensitivity to quantization, measured (`hybrid-engine quantize --plan auto`):
the mean KL divergence of the next-token distributions on calibration text between the float
checkpoint and a copy with that kind ALONE quantized, at int4 and at int8.

Both are measured, not one estimated from the other: on the cpu backend a quantized product
also rounds its activations to int8 in blocks of 32 (kernels/linear/quantized.py), an error
that does not shrink with the weights' bits, so int8's KL is not int4's scaled by the step
sizes' ratio (about 1/250 for the weight error alone).

The runs are the engine's own: each copy is written by quantize_checkpoint.write_checkpoint
(the very values a plan's checkpoint holds) and scored as `hybrid-engine perplexity` scores
(perplexity.score_windows: windows of the calibration tokens, the second half of each scored,
each position's top-k; kl_divergence.kl_divergence against the float run, done once). The MTP
layer's projections are not in that forward (it only drafts, and speculative decoding keeps
the outputs of the model it drafts for), so their KL is 0 by construction and not run; their
cost is draft acceptance, which this does not measure.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

DEFAULT_WINDOWS = 4
DEFAULT_CTX = 256
TOP_K = 64                       # `hybrid-engine perplexity --kl-top-k`'s default
UNMEASURED_KINDS = ("mtp",)


def default_calibration() -> tuple[str, str]:
    """(text, what it is): Python's own argparse.py, which every install has; code, like the
    text the default model was trained on."""
    path = Path(argparse.__file__)
    return path.read_text(encoding="utf-8"), f"python {sys.version_info.major}.{sys.version_info.minor} {path.name}"


def calibration_windows(token_ids: list[int], ctx: int, windows: int) -> list[list[int]]:
    from .perplexity import split_windows

    found = split_windows(token_ids, ctx, windows)
    if not found:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, fewer than one window of {ctx}")
    return found


def measure_sensitivity(src: str | Path, kinds: dict[str, set[str]], windows: list[list[int]], group_size: int,
                        work_dir: str | Path | None = None,
                        on_run: Callable[[str, int, float], None] | None = None) -> dict[str, dict[int, float]]:
    """kind -> {4: KL, 8: KL} of `src` with that kind's weights (internal names) alone quantized,
    against `src` as stored. The copies are written one at a time in a temporary folder under
    work_dir (None: the system's); on_run(kind, bits, kl) after each run (a progress line)."""
    from .quantize_checkpoint import write_checkpoint

    base = _score(src, windows)
    result = {}
    with tempfile.TemporaryDirectory(prefix="sensitivity-", dir=work_dir) as work:
        for kind, names in sorted(kinds.items()):
            result[kind] = {}
            for bits in (4, 8):
                if kind in UNMEASURED_KINDS:
                    kl = 0.0
                else:
                    copy = Path(work) / f"{kind}-int{bits}"
                    write_checkpoint(src, copy, dict.fromkeys(names, bits), group_size)
                    kl = _kl(base, _score(copy, windows))
                    shutil.rmtree(copy)
                result[kind][bits] = kl
                if on_run is not None:
                    on_run(kind, bits, kl)
    return result


def _score(model: str | Path, windows: list[list[int]]):
    from . import LLM
    from .perplexity import score_windows

    llm = LLM(model=str(model), enable_prefix_caching=False)
    try:
        return score_windows(llm, windows, TOP_K, batch=len(windows))
    finally:
        llm.shutdown()


def _kl(base, run) -> float:
    from .kl_divergence import kl_divergence

    return max(kl_divergence(base, run).kl[0], 0.0)       # rounding may leave a hair below 0
