"""benchmarks/bench_cpu.py: what a quantized model's projections hold (the bytes bench_llamacpp's
roofline has a quantized decode step read)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/
import bench_cpu  # noqa: E402


def test_quantized_weight_bytes_swap_each_projections_float_bytes_for_its_packed_ones():
    from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
    torch.manual_seed(0)
    model = nn.Module()
    model.proj = nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    model.merged = nn.Linear(64, 40, bias=False).to(torch.bfloat16)   # 32 quantized rows, an 8-row float tail
    model.norm = nn.LayerNorm(64)                                   # float, not a projection: not counted
    model.merged.shards = {"in_proj_qkv": 32, "in_proj_b": 4, "in_proj_a": 4}
    QuantizedLinearMethod(4, 32).process_weights_after_loading(model.proj)
    QuantizedLinearMethod(8, 32, float_shards=("in_proj_b", "in_proj_a")).process_weights_after_loading(model.merged)
    got = bench_cpu.quantized_weight_bytes(model)
    # int4: 48 rows x 64 columns / 2 bytes + a float16 scale per 32; int8 with an 8-row bf16 tail
    proj = 48 * 64 // 2 + 48 * 2 * 2
    merged = 32 * 64 + 32 * 2 * 2 + 8 * 64 * 2
    assert got == {"packed": proj + merged, "float": (48 + 40) * 64 * 2, "layers": 2}
