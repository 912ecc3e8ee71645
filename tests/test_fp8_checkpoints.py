"""Qwen's FP8 checkpoints (hybrid_engine/checkpoint_formats/fp8.py): block-scaled float8_e4m3
projections (`weight_scale_inv` multiplied, edges cut) load requantized to int8, exactly as a
float checkpoint of the dequantized weights does when the same projections are quantized online
(the ground truth: the plain path on the dequantized weights, quantized by the same rule); for
all three families, scales in bf16 / fp16 / fp32, 128 x 128 blocks (all edges here) and 32 x 32
ones, `model.language_model.` names; broken ones are one error naming the tensor or field."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
from hybrid_engine.kernels.linear.reference import shard_names
from hybrid_engine.models.config import CheckpointError
from hybrid_engine.quantization import Quantization, QuantizedLayers

from quantized_checkpoints import broken_copy, greedy_runs, mtp_engine, write_fp8_pair
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


class SameProjectionsOnline(QuantizedLayers):
    """Online int8 of exactly the projections the FP8 checkpoint holds in FP8."""

    def __init__(self, fp8_names: set[str], float_method, native: bool):
        super().__init__(Quantization("int8", 32), float_method, native)
        self.fp8_names = fp8_names

    def __call__(self, name, layer):
        if not hasattr(layer, "shards"):                 # a MoE layer's experts
            return super().__call__(name, layer) if f"{name}.0.gate_proj" in self.fp8_names else None
        bases = [base for base, _ in shard_names(layer, name)]
        if not any(base in self.fp8_names for base in bases):
            return self.float_method
        return QuantizedLinearMethod(8, 32, native=self.native, float_method=self.float_method, float_shards=tuple(
            base.rpartition(".")[2] for base in bases if base not in self.fp8_names))


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


@pytest.mark.parametrize("block,scale_dtype", [(128, torch.bfloat16), (32, torch.float16), (32, torch.float32)])
def test_fp8_checkpoint_runs_as_its_dequantized_weights_quantized(ckpt, tmp_path, monkeypatch, block, scale_dtype):
    names = write_fp8_pair(ckpt, tmp_path / "fp8", tmp_path / "float", block, scale_dtype,
                           language_model_prefix=block == 128)
    stored = mtp_engine(tmp_path / "fp8")
    layers = dict(stored.model.named_modules())
    assert isinstance(layers["layers.0.linear_attn.in_proj"].method, QuantizedLinearMethod) != ("qwen3_next" in str(ckpt))
    assert isinstance(layers["mtp.layers.0.self_attn.qkv_proj"].method, QuantizedLinearMethod)
    assert not isinstance(layers["lm_head"].method, QuantizedLinearMethod)
    got = greedy_runs(stored)
    from hybrid_engine import engine as engine_module
    native = layers["mtp.layers.0.self_attn.qkv_proj"].method.native
    monkeypatch.setattr(engine_module, "quantized_layers",
                        lambda config, float_method, kernels, gguf_file=None: SameProjectionsOnline(names, float_method, native))
    assert got == greedy_runs(mtp_engine(tmp_path / "float"))


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), "qwen3_5")
    root = tmp_path_factory.mktemp("fp8")
    write_fp8_pair(src, root / "fp8", root / "float", 32, torch.bfloat16)
    return root / "fp8"


SCALE = "model.layers.0.mlp.down_proj.weight_scale_inv"


@pytest.mark.parametrize("config_edit,tensors_edit,message", [
    (lambda q: q.update(fmt="e5m2"), None, "fmt 'e5m2' is not supported"),
    (lambda q: q.update(weight_block_size=None), None, "weight_block_size must be"),
    (lambda q: q.update(activation_scheme="static"), None, "activation_scheme 'static'"),
    (None, lambda t: t.pop(SCALE), None),
    (None, lambda t: t.update({SCALE: t[SCALE][:1].contiguous()}), "weight_scale_inv .*wrong shape"),
    (None, lambda t: t.update({SCALE: torch.full_like(t[SCALE], float("inf"))}), "NaN or Inf"),
])
def test_broken_fp8_checkpoints_are_one_clear_error(fp8_checkpoint, tmp_path, config_edit, tensors_edit, message):
    broken = broken_copy(fp8_checkpoint, tmp_path / "broken", config_edit, tensors_edit)
    if message is None:
        # without its scale the FP8 weight is no longer marked FP8: it would load as raw e4m3
        # values (W / scale), a silently wrong model. The loader refuses float8 weights that
        # no scale accompanies.
        message = "layers.0.mlp.down_proj.weight .*float8 without its weight_scale_inv"
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))
