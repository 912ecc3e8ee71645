"""Quantized checkpoint formats: each reads its config.json `quantization_config` into the
QuantizedCheckpoint its projections load through (kernels/linear/quantized.py), and says which
tensor beside a projection marks it quantized (`marker`). MoE experts are projections here too,
one per expert (`mlp.experts.{e}.down_proj.<marker>`: how every format stores them per expert).

    compressed_tensors.py   llm-compressor's pack-quantized W4A16 / W8A16, symmetric or with
                            zero points (and what `hybrid-engine quantize` writes)
    fp8.py                  Qwen's block-scaled FP8 releases, requantized to int8 at load
    gptq.py                 AutoGPTQ / GPTQModel int4 / int8 (symmetric or with zero points;
                            act-order too)
    rank_parts.py           each rank's part of a format's stored tensors under tensor
                            parallelism (every format; GPTQ's act-order refused)
"""

from __future__ import annotations

import json
from pathlib import Path

from hybrid_engine.models.config import CheckpointError

from . import compressed_tensors, fp8, gptq

READERS = {compressed_tensors.QUANT_METHOD: compressed_tensors.read_config, fp8.QUANT_METHOD: fp8.read_config,
           gptq.QUANT_METHOD: gptq.read_config}


def stored_quantization(folder: str | Path):
    """The QuantizedCheckpoint of a checkpoint stored quantized, None for a float one;
    CheckpointError naming the field of a quantization_config this engine does not read."""
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None                  # models/config.py reports an unreadable config.json
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    if quant is None:
        return None
    where = f"{path}: quantization_config"
    if not isinstance(quant, dict):
        raise CheckpointError(f"{where} is not an object")
    method = quant.get("quant_method")
    if method not in READERS:
        raise CheckpointError(f"{where}.quant_method {method!r} is not supported; this engine reads "
                              f"{', '.join(repr(m) for m in READERS)} checkpoints, or quantizes float ones "
                              "itself (quantization='int8' | 'int4')")
    return READERS[method](quant, where)
