"""compressed-tensors pack-quantized checkpoints (hybrid_engine/checkpoint_formats/compressed_tensors.py)
and `hybrid-engine quantize` (hybrid_engine/quantize_checkpoint.py): a checkpoint written by the
command loads quantized and runs exactly as online quantization of its source (the same values,
so the same bits), for all three families with MTP; one with zero points (symmetric: false)
runs as the float checkpoint of its dequantized weights, and the native kernel as its
reference; its packing is compressed-tensors' own; and every broken or unsupported checkpoint
is one error naming the tensor or field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from safetensors.torch import load_file

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.checkpoint_formats.compressed_tensors import pack_int32, unpack_int32
from hybrid_engine.cli import main as cli_main
from hybrid_engine.kernels.backends import native_cpu_available
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
from hybrid_engine.models.config import CheckpointError
from hybrid_engine import quantization
from hybrid_engine.models.linear import Linear
from hybrid_engine.quantization import METHODS, Quantization
from hybrid_engine.quantize_checkpoint import write_quantized

from quantized_checkpoints import broken_copy, greedy_runs, mtp_engine, write_asymmetric_pair
from checkpoints import make_hf_model, save_checkpoint
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


@pytest.mark.parametrize("method,group", [("int8", 32), ("int4", 32), ("int4", 64)])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_written_checkpoint_runs_as_online_quantization(ckpt, tmp_path, monkeypatch, method, group, backend):
    dst = tmp_path / "q"
    write_quantized(ckpt, dst, Quantization(method, group))
    assert (dst / "model.safetensors").stat().st_size < (ckpt / "model.safetensors").stat().st_size
    stored = mtp_engine(dst, backend)
    layers = dict(stored.model.named_modules())
    mlp = "layers.0.mlp.shared_expert.gate_up_proj" if "layers.0.mlp.experts" in layers else "layers.0.mlp.gate_up_proj"
    for name in ("layers.0.linear_attn.in_proj", mlp, "mtp.layers.0.self_attn.qkv_proj"):
        assert isinstance(layers[name].method, QuantizedLinearMethod), name
    assert layers["layers.0.linear_attn.in_proj"].method.float_shards == ("in_proj_b", "in_proj_a")
    assert not isinstance(layers["mtp.fc"].method, QuantizedLinearMethod)
    if "layers.0.mlp.experts" in layers:
        # experts are written per expert, quantized where the group size divides their widths
        # (the tiny MoE's moe_intermediate_size 32: not in groups of 64), and read back so
        for name in ("layers.0.mlp.experts.3.down_proj", "mtp.layers.0.mlp.experts.3.gate_up_proj"):
            assert isinstance(getattr(layers.get(name), "method", None), QuantizedLinearMethod) == (group == 32)
        assert not isinstance(layers["layers.0.mlp.gate"], Linear)           # the router: plain float
    # the (untied) lm_head at the scheme's bits, as online quantization holds it
    assert layers["lm_head"].method.bits == METHODS[method]
    online = mtp_engine(ckpt, backend, quantization=method, quantization_group_size=group)
    assert greedy_runs(stored) == greedy_runs(online)


def test_fused_experts_are_written_per_expert(tmp_path):
    """A checkpoint storing its experts fused (experts.gate_up_proj [E, 2I, H], experts.down_proj)
    writes what the same model stored per expert writes, tensor for tensor: each expert's
    gate_proj / up_proj / down_proj packed on its own (vLLM's compressed-tensors MoE names)."""
    model = make_hf_model("qwen3_5_moe", tie_word_embeddings=False)
    written = {}
    for fused in (True, False):
        src = save_checkpoint(model, tmp_path / f"src{fused}", fused_experts=fused, add_mtp=True)
        write_quantized(src, tmp_path / f"q{fused}", Quantization("int4", 32))
        written[fused] = load_file(str(tmp_path / f"q{fused}" / "model.safetensors"))
    assert written[True].keys() == written[False].keys()
    for name in written[True]:
        assert torch.equal(written[True][name], written[False][name]), name
    for name in ("model.layers.1.mlp.experts.3.up_proj.weight_packed", "mtp.layers.0.mlp.experts.0.down_proj.weight_scale"):
        assert name in written[True]
    assert not any(name.endswith(("experts.gate_up_proj", "experts.down_proj")) for name in written[True])


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_asymmetric_checkpoint_runs_as_its_dequantized_weights(ckpt, tmp_path, bits, group):
    """The torch backend's product (float x) on the dequantized weights: the float32 run's
    greedy tokens for 32 steps, its logprobs within float rounding."""
    write_asymmetric_pair(ckpt, tmp_path / "ct", tmp_path / "float", bits, group)
    stored = mtp_engine(tmp_path / "ct", "torch")
    layers = dict(stored.model.named_modules())
    for name in ("layers.0.linear_attn.in_proj", "mtp.layers.0.self_attn.qkv_proj", "lm_head"):
        assert layers[name].qzeros is not None and layers[name].qzeros.any(), name
    want = greedy_runs(mtp_engine(tmp_path / "float", "torch"), max_tokens=32)
    got = greedy_runs(stored, max_tokens=32)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(want, got):
        assert g_ids == w_ids and len(g_ids) == 32
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


@pytest.mark.skipif(not native_cpu_available(), reason="no native kernels at this CPU level")
def test_native_asymmetric_checkpoint_matches_its_reference(ckpt, tmp_path, monkeypatch):
    """The native kernel's zero-point forms in a whole model: the reference's tokens and logprobs."""
    write_asymmetric_pair(ckpt, tmp_path / "ct", tmp_path / "float", 4, 32)
    native = greedy_runs(mtp_engine(tmp_path / "ct", "cpu"), max_tokens=32)
    from hybrid_engine import engine as engine_module, quantization
    from hybrid_engine.checkpoint_formats import stored_quantization
    from hybrid_engine.models.loader import checkpoint_names
    monkeypatch.setattr(engine_module, "quantized_layers", lambda config, float_method, kernels, gguf_file=None: (
        quantization.CheckpointLayers(stored_quantization(config.model), checkpoint_names(config.model),
                                      float_method, native=False, int8_activations=True)))
    assert greedy_runs(mtp_engine(tmp_path / "ct", "cpu"), max_tokens=32) == native


def test_tied_lm_head_stays_float(tmp_path, monkeypatch):
    """The default model ties lm_head to its embedding: the written checkpoint keeps that table
    float, and otherwise runs as online quantization with lm_head left float."""
    from hybrid_engine.default_model import default_model_path
    dst = tmp_path / "q"
    done = write_quantized(default_model_path(), dst, Quantization("int4", 32))
    assert done and not any("embed_tokens" in name for name in done)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    stored = LLM(model=str(dst), dtype="float32")
    assert not isinstance(stored.engine.model.lm_head.method, QuantizedLinearMethod)
    got = stored.generate(["def read_config(path):", "import os\n"], params)
    monkeypatch.setattr(quantization, "FLOAT_LAYERS", quantization.FLOAT_LAYERS + ("lm_head",))
    want = LLM(dtype="float32", quantization="int4").generate(["def read_config(path):", "import os\n"], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]


def test_packing_is_compressed_tensors_own():
    # pack_to_int32's documented example: num_bits 8, values [1, 2] -> 33409
    assert pack_int32(torch.tensor([[1, 2]], dtype=torch.int8), 8).tolist() == [[33409]]
    # int4: eight values a word, the first in the lowest bits, each + 8
    word = pack_int32(torch.tensor([[-8, -7, 0, 7, 1, 2, 3, -1]], dtype=torch.int8), 4)
    assert word.dtype == torch.int32
    nibbles = [(int(word) >> (4 * i)) & 15 for i in range(8)]
    assert nibbles == [0, 1, 8, 15, 9, 10, 11, 7]


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 5), cols=st.integers(1, 40), seed=st.integers(0, 1000))
def test_pack_and_unpack_int32_round_trip(bits, rows, cols, seed):
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    values = torch.randint(lo, hi + 1, (rows, cols), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_int32(values, bits)
    assert packed.shape == (rows, -(-cols * bits // 32))
    assert torch.equal(unpack_int32(packed, bits, cols), values)


def test_zero_points_pack_along_the_output_dimension():
    # compressed-tensors' pack_to_int32(..., packed_dim=0): a column's rows fill a word, lowest first
    zeros = torch.tensor([[-8, 7], [-7, 0], [0, 1], [7, -1], [1, 2], [2, 3], [3, 4], [-1, 5], [5, 6]], dtype=torch.int8)
    packed = pack_int32(zeros, 4, dim=0)
    assert packed.shape == (2, 2) and packed.dtype == torch.int32
    assert [(int(packed[0, 0]) >> (4 * i)) & 15 for i in range(8)] == [0, 1, 8, 15, 9, 10, 11, 7]
    assert int(packed[1, 0]) == 13 and int(packed[1, 1]) == 14           # the ninth row alone, + 8
    assert torch.equal(unpack_int32(packed, 4, 9, dim=0), zeros)


@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([4, 8]), rows=st.integers(1, 40), groups=st.integers(1, 5), seed=st.integers(0, 1000))
def test_pack_and_unpack_zero_points_round_trip(bits, rows, groups, seed):
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    zeros = torch.randint(lo, hi + 1, (rows, groups), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)
    packed = pack_int32(zeros, bits, dim=0)
    assert packed.shape == (-(-rows * bits // 32), groups)
    assert torch.equal(unpack_int32(packed, bits, rows, dim=0), zeros)


@pytest.fixture(scope="module")
def int4_checkpoint(tmp_path_factory):
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), "qwen3_5")
    dst = tmp_path_factory.mktemp("q") / "q"
    write_quantized(src, dst, Quantization("int4", 32))
    return dst


SCALE = "model.layers.0.mlp.down_proj.weight_scale"


@pytest.mark.parametrize("config_edit,tensors_edit,message", [
    (lambda q: q.update(quant_method="awq"), None, "quant_method 'awq' is not supported; this engine reads "
                                                   "'compressed-tensors', 'fp8', 'gptq'"),
    (lambda q: q.update(format="int-quantized"), None, "format 'int-quantized' is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(symmetric="no"), None,
     "symmetric is 'no', not true or false"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(num_bits=3), None, "num_bits 3 is not supported"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(group_size=48), None, "group_size 48 is not a multiple"),
    (lambda q: q["config_groups"]["group_0"]["weights"].update(actorder="group"), None, "actorder 'group'"),
    (None, lambda t: t.pop(SCALE), "missing 1 tensor\\(s\\): layers.0.mlp.down_proj.weight_scale"),
    (None, lambda t: t.update({SCALE: t[SCALE][:, :1].contiguous()}), "tensor model.layers.0.mlp.down_proj.weight_scale .*wrong shape"),
    (None, lambda t: t.update({SCALE.replace("scale", "shape"): torch.tensor([3, 3], dtype=torch.int32)}),
     "weight_shape holds \\[3, 3\\]"),
    (None, lambda t: t.update({SCALE.replace("scale", "packed"): t[SCALE.replace("scale", "packed")].float()}),
     "weight_packed is torch.float32, not int32"),
])
def test_broken_checkpoints_are_one_clear_error(int4_checkpoint, tmp_path, config_edit, tensors_edit, message):
    broken = broken_copy(int4_checkpoint, tmp_path / "broken", config_edit, tensors_edit)
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def _asymmetric_checkpoint(tmp_path_factory, family: str) -> Path:
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), family)
    root = tmp_path_factory.mktemp("asym")
    write_asymmetric_pair(src, root / "ct", root / "float", 4, 32)
    return root / "ct"


@pytest.fixture(scope="module")
def asymmetric_checkpoint(tmp_path_factory):
    return _asymmetric_checkpoint(tmp_path_factory, "qwen3_5")


ZERO_POINT = "model.layers.0.mlp.down_proj.weight_zero_point"
QKVZ_ZERO_POINT = "model.layers.0.linear_attn.in_proj_qkvz.weight_zero_point"


@pytest.mark.parametrize("tensors_edit,message", [
    (lambda t: t.pop(ZERO_POINT), "missing 1 tensor\\(s\\): layers.0.mlp.down_proj.weight_zero_point"),
    (lambda t: t.update({ZERO_POINT: t[ZERO_POINT][:, :1].contiguous()}),
     "tensor model.layers.0.mlp.down_proj.weight_zero_point .*wrong shape"),
    (lambda t: t.update({ZERO_POINT: torch.cat([t[ZERO_POINT], t[ZERO_POINT]])}),
     "tensor model.layers.0.mlp.down_proj.weight_zero_point .*wrong shape"),
    (lambda t: t.update({ZERO_POINT: t[ZERO_POINT].float()}), "weight_zero_point is torch.float32, not int32"),
])
def test_broken_zero_points_are_one_clear_error(asymmetric_checkpoint, tmp_path, tensors_edit, message):
    broken = broken_copy(asymmetric_checkpoint, tmp_path / "broken", None, tensors_edit)
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_broken_grouped_zero_points_name_the_grouped_tensor(tmp_path_factory, tmp_path):
    """Qwen3-Next's in_proj_qkvz zero points are packed along its grouped rows: checked there."""
    broken = broken_copy(_asymmetric_checkpoint(tmp_path_factory, "qwen3_next"), tmp_path / "broken", None,
                         lambda t: t.update({QKVZ_ZERO_POINT: t[QKVZ_ZERO_POINT][:-1].contiguous()}))
    with pytest.raises(CheckpointError, match="tensor model.layers.0.linear_attn.in_proj_qkvz.weight_zero_point "
                                              ".*wrong shape"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_symmetric_checkpoint_without_zero_points_refuses_them(int4_checkpoint, tmp_path):
    """A zero point beside a symmetric checkpoint's projection is a tensor the model does not take."""
    broken = broken_copy(int4_checkpoint, tmp_path / "broken", None, lambda t: t.update(
        {ZERO_POINT: torch.zeros(t[SCALE].shape[0] // 8, t[SCALE].shape[1], dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="unexpected tensor\\(s\\): .*down_proj.weight_zero_point"):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_quantization_on_a_quantized_checkpoint_is_refused(int4_checkpoint):
    with pytest.raises(ValueError, match="stored quantized already"):
        LLMEngine(EngineConfig(model=str(int4_checkpoint), quantization="int8"))


def test_quantize_command(tmp_path, capsys):
    from hybrid_engine.default_model import default_model_path
    dst = tmp_path / "out"
    assert cli_main(["quantize", str(default_model_path()), str(dst), "--method", "int8"]) == 0
    assert "projections as int8 in groups of 32" in capsys.readouterr().out
    assert json.loads((dst / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "weights"]["num_bits"] == 8
    assert cli_main(["quantize", str(default_model_path()), str(dst), "--method", "int8"]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert cli_main(["quantize", str(default_model_path()), str(tmp_path / "b"), "--method", "int4",
                     "--group-size", "48"]) == 2
    assert "not a multiple of 32" in capsys.readouterr().err
    assert cli_main(["quantize", str(dst), str(tmp_path / "c"), "--method", "int4"]) == 2
    assert "stored quantized already" in capsys.readouterr().err
