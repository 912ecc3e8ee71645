"""GPTQ checkpoints (hybrid_engine/checkpoint_formats/gptq.py): int4 / int8, symmetric and with
real zero points (sym: false), v1 and v2 zero points, with and without act-order (desc_act:
scattered groups, x gathered into the stored column order): a GPTQ checkpoint runs as the float
checkpoint of its dequantized weights (the plain path on the same weights: the torch backend,
float x), and the native kernel as its torch reference on the same gathered x; broken or
unsupported ones are one error naming the tensor or field."""

from __future__ import annotations

import pytest
import torch

from hybrid_engine import EngineConfig, LLMEngine
from hybrid_engine.checkpoint_formats.int32_fields import pack_fields
from hybrid_engine.kernels.backends import native_cpu_available
from hybrid_engine.checkpoint_formats.gptq import Gptq
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod, dequantize
from hybrid_engine.models.config import CheckpointError

from quantized_checkpoints import broken_copy, greedy_runs, mtp_engine, write_gptq_pair
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
needs_native = pytest.mark.skipif(not native_cpu_available(), reason="no native kernels at this CPU level")


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


@pytest.mark.parametrize("bits,group,desc_act,version", [(4, 32, False, "gptq"), (4, 32, True, "gptq"),
                                                         (8, 64, True, "gptq_v2")])
def test_gptq_checkpoint_runs_as_its_dequantized_weights(ckpt, tmp_path, bits, group, desc_act, version):
    write_gptq_pair(ckpt, tmp_path / "gptq", tmp_path / "float", bits, group, desc_act, version)
    stored = mtp_engine(tmp_path / "gptq", "torch")
    layer = dict(stored.model.named_modules())["mtp.layers.0.self_attn.qkv_proj"]
    # (with one group per row, 64 columns in groups of 64, any order keeps the groups: none needed)
    assert isinstance(layer.method, QuantizedLinearMethod)
    assert (layer.input_order is not None) == (desc_act and group < layer.in_features)
    want, got = greedy_runs(mtp_engine(tmp_path / "float", "torch")), greedy_runs(stored)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(want, got):
        assert g_ids == w_ids
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


@pytest.mark.parametrize("bits,group,desc_act,version", [(4, 32, True, "gptq"), (8, 32, False, "gptq_v2"),
                                                         (8, 64, True, "gptq")])
def test_asymmetric_gptq_checkpoint_runs_as_its_dequantized_weights(ckpt, tmp_path, bits, group, desc_act, version):
    """sym: false, real zero points: the float32 run of the dequantized weights, 32 greedy steps."""
    write_gptq_pair(ckpt, tmp_path / "gptq", tmp_path / "float", bits, group, desc_act, version, sym=False)
    stored = mtp_engine(tmp_path / "gptq", "torch")
    layer = dict(stored.model.named_modules())["mtp.layers.0.self_attn.qkv_proj"]
    assert layer.qzeros is not None and layer.qzeros.any()
    want = greedy_runs(mtp_engine(tmp_path / "float", "torch"), max_tokens=32)
    got = greedy_runs(stored, max_tokens=32)
    for (w_ids, w_lp), (g_ids, g_lp) in zip(want, got):
        assert g_ids == w_ids and len(g_ids) == 32
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=1e-4, rtol=0)


@needs_native
@pytest.mark.parametrize("sym", [True, False])
def test_native_act_order_matches_its_reference(ckpt, tmp_path, monkeypatch, sym):
    write_gptq_pair(ckpt, tmp_path / "gptq", tmp_path / "float", 4, 32, True, sym=sym)
    native = greedy_runs(mtp_engine(tmp_path / "gptq", "cpu"))
    from hybrid_engine import engine as engine_module, quantization
    from hybrid_engine.checkpoint_formats import stored_quantization
    from hybrid_engine.models.loader import checkpoint_names
    monkeypatch.setattr(engine_module, "quantized_layers", lambda config, float_method, kernels, gguf_file=None: (
        quantization.CheckpointLayers(stored_quantization(config.model), checkpoint_names(config.model),
                                      float_method, native=False, int8_activations=True)))
    assert greedy_runs(mtp_engine(tmp_path / "gptq", "cpu")) == native


@pytest.fixture(scope="module")
def gptq_checkpoint(tmp_path_factory):
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), "qwen3_5")
    root = tmp_path_factory.mktemp("gptq")
    write_gptq_pair(src, root / "gptq", root / "float", 4, 32, True)
    return root / "gptq"


@pytest.fixture(scope="module")
def asymmetric_gptq_checkpoint(tmp_path_factory):
    src = make_spec_checkpoint(tmp_path_factory.mktemp("src"), "qwen3_5")
    root = tmp_path_factory.mktemp("gptq")
    write_gptq_pair(src, root / "gptq", root / "float", 8, 32, False, sym=False)
    return root / "gptq"


BASE = "model.layers.0.mlp.down_proj"


@pytest.mark.parametrize("config_edit,tensors_edit,message", [
    (lambda q: q.update(sym="no"), None, "sym is 'no', not true or false"),
    (lambda q: q.update(bits=3), None, "bits 3 is not supported"),
    (lambda q: q.update(group_size=-1), None, "group_size -1 is not supported"),
    (lambda q: q.update(checkpoint_format="marlin"), None, "checkpoint_format 'marlin'"),
    (None, lambda t: t.update({f"{BASE}.qzeros": t[f"{BASE}.qzeros"] + 1}),
     "qzeros holds zero points other than 8, but the config says sym: true"),
    (None, lambda t: t.update({f"{BASE}.g_idx": torch.zeros_like(t[f"{BASE}.g_idx"])}), "g_idx does not put 32"),
    (None, lambda t: t.pop(f"{BASE}.scales"), "missing 1 tensor\\(s\\): layers.0.mlp.down_proj.scales"),
    (None, lambda t: t.update({f"{BASE}.qweight": t[f"{BASE}.qweight"].float()}), "qweight is torch.float32, not int32"),
])
def test_broken_gptq_checkpoints_are_one_clear_error(gptq_checkpoint, tmp_path, config_edit, tensors_edit, message):
    broken = broken_copy(gptq_checkpoint, tmp_path / "broken", config_edit, tensors_edit)
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))


def test_v1_zero_points_are_the_field_plus_one_without_wrapping():
    """v1's stored 15 at int4 is a zero point of 16 (vLLM's GPTQ kernels read it so), held as 16 - 8."""
    fields = torch.tensor([[15, 0, 7, 14, 3, 1, 2, 9]])                    # one group, 8 columns
    codes = torch.arange(32 * 8).reshape(32, 8) % 16
    tensors = {"qweight": pack_fields(codes, 4, dim=0), "qzeros": pack_fields(fields, 4, dim=1),
               "scales": torch.full((1, 8), 0.5, dtype=torch.float16), "g_idx": torch.zeros(32, dtype=torch.int32)}
    qw = Gptq(4, 32, zero_offset=1, symmetric=False).read("p", tensors, rows=8, in_features=32)
    assert qw.zeros.t().tolist() == [[8, -7, 0, 7, -4, -6, -5, 2]]
    assert torch.equal(dequantize(qw), (codes.t() - (fields.t() + 1)).float() * 0.5)


def _set_first_zero(tensors, field: int) -> None:
    qzeros = tensors[f"{BASE}.qzeros"].clone()
    qzeros[0, 0] = (int(qzeros[0, 0]) & ~0xFF) | field
    tensors[f"{BASE}.qzeros"] = qzeros


@pytest.mark.parametrize("tensors_edit,message", [
    (lambda t: t.pop(f"{BASE}.qzeros"), "missing 1 tensor\\(s\\): layers.0.mlp.down_proj.qzeros"),
    (lambda t: t.update({f"{BASE}.qzeros": t[f"{BASE}.qzeros"][:, :-1].contiguous()}),
     "tensor model.layers.0.mlp.down_proj.qzeros .*wrong shape"),
    (lambda t: t.update({f"{BASE}.qzeros": t[f"{BASE}.qzeros"].float()}), "qzeros is torch.float32, not int32"),
    # v1 stores each zero point less one: a stored 255 is 256, which 8 bits cannot hold
    (lambda t: _set_first_zero(t, 255), "tensor layers.0.mlp.down_proj.qzeros holds a zero point of 256, "
                                        "beyond 8 bits"),
])
def test_broken_asymmetric_gptq_is_one_clear_error(asymmetric_gptq_checkpoint, tmp_path, tensors_edit, message):
    broken = broken_copy(asymmetric_gptq_checkpoint, tmp_path / "broken", None, tensors_edit)
    with pytest.raises(CheckpointError, match=message):
        LLMEngine(EngineConfig(model=str(broken), dtype="float32"))
