"""MoE experts stored quantized, per expert (`mlp.experts.{e}.{gate,up,down}_proj.` + the format's
tensors), in each checkpoint format: compressed-tensors pack-quantized int4, GPTQ int4 with
act-order, Qwen's FP8 with 128 x 128 block scales. Only the routed experts are quantized here
(the shared expert, the router, attention and GDN stay float: a mix, as the checkpoint chooses
per module); each loads its experts as quantized projection layers and runs, for 32 greedy
steps with MTP, as the float checkpoint of the weights the engine holds (the stored values
dequantized; FP8's requantized to int8 in groups of 32) on the torch backend. A checkpoint with
an expert's scales missing or of the wrong shape is one error naming the tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from hybrid_engine import EngineConfig, LLMEngine
from hybrid_engine.checkpoint_formats import compressed_tensors, fp8
from hybrid_engine.checkpoint_formats.int32_fields import pack_fields
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod, dequantize, quantize
from hybrid_engine.models.config import CheckpointError

from quantized_checkpoints import broken_copy, greedy_runs, mtp_engine, save_pair, to_fp8
from spec_models import make_spec_checkpoint

GROUP = 32


def as_compressed_tensors(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One projection's weight -> (its stored tensors by suffix, the weight the engine holds)."""
    qw = quantize(w, 4, GROUP)
    return ({"weight_packed": compressed_tensors.pack_int32(qw.values, 4), "weight_scale": qw.scales,
             "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32)}, dequantize(qw))


def as_gptq(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Symmetric int4 v1 with act-order: one column order per input width (an expert's gate and
    up read the same input, so they share it)."""
    out, cols = w.shape
    order = torch.randperm(cols, generator=torch.Generator().manual_seed(cols))
    qw = quantize(w[:, order], 4, GROUP)
    values = torch.empty_like(qw.values).index_copy_(1, order, qw.values)
    g_idx = torch.empty(cols, dtype=torch.int32).index_copy_(0, order, (torch.arange(cols) // GROUP).to(torch.int32))
    stored = {"qweight": pack_fields((values.to(torch.int64) + 8).t(), 4, dim=0),
              "qzeros": pack_fields(torch.full((cols // GROUP, out), 7), 4, dim=1),
              "scales": qw.scales.t().contiguous(), "g_idx": g_idx}
    return stored, torch.empty_like(w).index_copy_(1, order, dequantize(qw))


def as_fp8(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """128 x 128 blocks (one, cut at both edges, at these widths); the engine requantizes the
    dequantized weight to int8 in groups of 32."""
    values, scale = to_fp8(w, 128, torch.bfloat16)
    rows, cols = w.shape
    expanded = scale.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    return {"weight": values, "weight_scale_inv": scale}, dequantize(quantize(values.float() * expanded, 8, GROUP))


FORMATS = {
    "compressed-tensors": (as_compressed_tensors, "weight_scale", compressed_tensors.quantization_config(
        [(compressed_tensors.PackQuantized(4, GROUP), ["Linear"])], ["lm_head"])),
    "gptq": (as_gptq, "scales", {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True,
                                 "sym": True, "checkpoint_format": "gptq"}),
    "fp8": (as_fp8, "weight_scale_inv", fp8.quantization_config((128, 128), ["lm_head"])),
}


def write_expert_pair(src: Path, quantized_dir: Path, float_dir: Path, fmt: str) -> None:
    """A copy of `src` with its routed experts (layers' and the MTP layer's) stored in `fmt`, and
    a float copy of the weights the engine holds for them."""
    store = FORMATS[fmt][0]
    as_quantized, as_float = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if ".experts." in name and name.endswith("_proj.weight"):
            stored, held = store(w)
            base = name.removesuffix(".weight")
            as_quantized.update({f"{base}.{suffix}": t for suffix, t in stored.items()})
            as_float[name] = held
        else:
            as_quantized[name] = as_float[name] = w
    save_pair(src, (quantized_dir, as_quantized, FORMATS[fmt][2]), (float_dir, as_float))


@pytest.fixture(scope="module", params=("qwen3_5_moe", "qwen3_next"))
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_experts_run_as_their_dequantized_weights(ckpt, tmp_path, fmt):
    write_expert_pair(ckpt, tmp_path / "q", tmp_path / "float", fmt)
    stored = mtp_engine(tmp_path / "q", "torch")
    layers = dict(stored.model.named_modules())
    for layer in ("layers.0", "layers.3", "mtp.layers.0"):
        experts = layers[f"{layer}.mlp.experts"]
        assert not hasattr(experts, "gate_up_proj")                     # no stacked float copy
        for e in range(experts.num_experts):
            for proj in ("gate_up_proj", "down_proj"):
                assert isinstance(layers[f"{layer}.mlp.experts.{e}.{proj}"].method, QuantizedLinearMethod)
        assert not isinstance(layers[f"{layer}.mlp.shared_expert.gate_up_proj"].method, QuantizedLinearMethod)
        assert type(layers[f"{layer}.mlp.gate"]) is nn.Linear and type(layers[f"{layer}.mlp.shared_expert_gate"]) is nn.Linear
    if fmt == "gptq":                                  # act-order: x gathered into the stored order
        assert layers["layers.0.mlp.experts.0.gate_up_proj"].input_order is not None
    want = greedy_runs(mtp_engine(tmp_path / "float", "torch"), max_tokens=32)
    got = greedy_runs(stored, max_tokens=32)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(want, got):
        assert g_ids == w_ids and len(g_ids) == 32
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def expert_checkpoints(tmp_path_factory):
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), "qwen3_5_moe")
    root = tmp_path_factory.mktemp("experts")
    for fmt in FORMATS:
        write_expert_pair(src, root / fmt, root / f"{fmt}-float", fmt)
    return root


EXPERT = "model.layers.0.mlp.experts"


def _pop_scale(e: int, proj: str):
    return lambda tensors, scale: tensors.pop(f"{EXPERT}.{e}.{proj}.{scale}")


def _double_scale(e: int, proj: str):
    def edit(tensors, scale):
        name = f"{EXPERT}.{e}.{proj}.{scale}"
        tensors[name] = torch.cat([tensors[name], tensors[name]])
    return edit


# (FP8's scale is its marker: without it the expert's down_proj is a float projection, whose
# float8 weight the loader refuses)
MISSING = {"compressed-tensors": "missing 1 tensor\\(s\\): layers.0.mlp.experts.1.down_proj.weight_scale$",
           "gptq": "missing 1 tensor\\(s\\): layers.0.mlp.experts.1.down_proj.scales$",
           "fp8": "tensor model.layers.0.mlp.experts.1.down_proj.weight in model.safetensors is float8 without "
                  "its weight_scale_inv"}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("edit,message", [
    (_pop_scale(1, "down_proj"), None),
    (_double_scale(2, "up_proj"), "tensor model.layers.0.mlp.experts.2.up_proj.{scale} .*wrong shape"),
])
def test_broken_expert_scales_are_one_clear_error(expert_checkpoints, tmp_path, fmt, edit, message):
    scale = FORMATS[fmt][1]
    broken = broken_copy(expert_checkpoints / fmt, tmp_path / "broken", tensors_edit=lambda t: edit(t, scale))
    with pytest.raises(CheckpointError, match=MISSING[fmt] if message is None else message.format(scale=scale)):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_fp8_experts_without_any_scales_are_refused(expert_checkpoints, tmp_path):
    """With none of a layer's scales its experts are no longer marked FP8: the loader refuses
    their float8 weights instead of loading the raw e4m3 values (W / scale)."""
    def drop(tensors):
        for name in [n for n in tensors if n.startswith(EXPERT) and n.endswith(".weight_scale_inv")]:
            tensors.pop(name)
    broken = broken_copy(expert_checkpoints / "fp8", tmp_path / "broken", tensors_edit=drop)
    with pytest.raises(CheckpointError, match="tensor model.layers.0.mlp.experts.\\d.(gate|up|down)_proj.weight in "
                                              "model.safetensors is float8 without its weight_scale_inv"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))
