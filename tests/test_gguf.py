"""GGUF files (hybrid_engine/checkpoint_formats/gguf.py), written here as llama.cpp's converter
writes them (tests/support/gguf_files.py: by hand, its files equalled llama.cpp's own
converter's tensor for tensor on tiny checkpoints of the three families): an F32 file runs as its HF folder, every parameter loaded equal; Q8_0
and Q4_0 files load their blocks as int8 / int4 group-32 values and scales unchanged and run as
the float run of the same dequantized weights; Q4_K / Q6_K are requantized as online
quantization of their dequantized weights would be; the tokenizer comes from the metadata; and
each broken or unsupported file is one CheckpointError naming the tensor or key."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_engine import LLM, LLMEngine, SamplingParams
from hybrid_engine.cli import main as cli_main
from hybrid_engine import quantization
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod, unpack
from hybrid_engine.models.config import CheckpointError

from checkpoints import make_hf_model, save_checkpoint
from gguf_files import write_gguf
from quantized_checkpoints import greedy_runs, mtp_engine
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def _engine(model, backend="torch", **kwargs) -> LLMEngine:
    return mtp_engine(model, backend, **kwargs)


def _assert_same_run(got: list, want: list, tol: float = 1e-4) -> None:
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, a), (_, b) in zip(got, want):
        assert np.allclose(a, b, atol=tol, rtol=0), (a, b)


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    # value heads of 32: out_proj's columns, tiled by head in the file, move in whole blocks
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6,
                                linear_value_head_dim=32)


def test_f32_file_runs_as_its_hf_folder(ckpt, tmp_path):
    path = write_gguf(ckpt, tmp_path / "m.gguf")
    from_gguf, from_folder = _engine(path), _engine(ckpt)
    assert from_gguf.model_config == from_folder.model_config
    ours, theirs = dict(from_gguf.model.named_parameters()), dict(from_folder.model.named_parameters())
    assert ours.keys() == theirs.keys() and any(name.startswith("mtp.") for name in ours)
    for name, p in ours.items():      # the +1 norms and -exp(A_log) round in float32 once each way
        torch.testing.assert_close(p, theirs[name], atol=1e-6, rtol=1e-6, msg=name)
    _assert_same_run(greedy_runs(from_gguf), greedy_runs(from_folder))


@pytest.mark.parametrize("qtype,bits", [("Q8_0", 8), ("Q4_0", 4)])
def test_quantized_file_runs_as_its_dequantized_weights(ckpt, tmp_path, qtype, bits):
    path = write_gguf(ckpt, tmp_path / "q.gguf", qtype)
    reference = write_gguf(ckpt, tmp_path / "deq.gguf", qtype, dequantized=True)
    engine = _engine(path)
    layers = dict(engine.model.named_modules())
    mlp = "layers.0.mlp.shared_expert.gate_up_proj" if "layers.0.mlp.experts" in layers else "layers.0.mlp.gate_up_proj"
    for name in ("layers.0.linear_attn.in_proj", "layers.0.linear_attn.out_proj", mlp,
                 "mtp.layers.0.self_attn.qkv_proj", "lm_head"):
        method = layers[name].method
        assert isinstance(method, QuantizedLinearMethod) and (method.bits, method.group_size) == (bits, 32), name
    assert layers["layers.0.linear_attn.in_proj"].method.float_shards == ("in_proj_b", "in_proj_a")
    assert not isinstance(layers["mtp.fc"].method, QuantizedLinearMethod)
    experts = [m for name, m in layers.items() if name.endswith("mlp.experts")]
    for e in (e for m in experts for e in m.per_expert):           # MoE experts: quantized, per expert
        for proj in (e.gate_up_proj, e.down_proj):
            assert isinstance(proj.method, QuantizedLinearMethod) and proj.method.bits == bits
            assert proj.qweight is not None
    assert bool(experts) == (ckpt.name.startswith(("qwen3_5_moe", "qwen3_next")))
    _assert_same_run(greedy_runs(engine), greedy_runs(_engine(reference)))


@pytest.mark.parametrize("qtype,method", [("Q8_0", "int8"), ("Q4_0", "int4")])
def test_quantized_file_runs_as_online_quantization_on_the_default_backend(ckpt, tmp_path, monkeypatch, qtype,
                                                                           method):
    """Online quantization of the dequantized weights gives the file's blocks again (int8: llama.cpp's
    Q8_0 rule; int4: its search finds the Q4_0 scale, whose error there is 0), so the native kernels
    (x rounded to int8) give the same bits. MoE experts too: the file's are read dequantized and
    quantized per expert at the file's bits, as online quantization does. (The file's output
    table is Q4_0 too, lookups included: online int4's int8 rows for a tied table's lookups are
    set to int4 here.)"""
    monkeypatch.setattr(quantization, "LOOKUP_MIN_BITS", 4)
    path = write_gguf(ckpt, tmp_path / "q.gguf", qtype)
    reference = write_gguf(ckpt, tmp_path / "deq.gguf", qtype, dequantized=True)
    assert greedy_runs(_engine(path, "auto")) == greedy_runs(_engine(reference, "auto", quantization=method))


@pytest.mark.parametrize("qtype", ["F16", "BF16"])
def test_16_bit_float_files_load_as_float(small, tmp_path, qtype):
    engine = _engine(write_gguf(small, tmp_path / "h.gguf", qtype))
    assert not any(isinstance(m.method, QuantizedLinearMethod) for m in engine.model.modules() if hasattr(m, "method"))
    assert greedy_runs(engine) == greedy_runs(_engine(write_gguf(small, tmp_path / "d.gguf", qtype, dequantized=True)))


def test_blocks_load_unchanged(tmp_path):
    """Q8_0 / Q4_0 blocks are the layer's values and scales as they are: its weight is gguf's own
    dequantization of the file's blocks, bit for bit."""
    import gguf
    ckpt = make_spec_checkpoint(tmp_path / "hf", "qwen3_5")
    for qtype in ("Q8_0", "Q4_0"):
        path = write_gguf(ckpt, tmp_path / f"{qtype}.gguf", qtype)
        engine = _engine(path)
        tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
        layer = dict(engine.model.named_modules())["layers.0.mlp.gate_up_proj"]
        want = np.concatenate([gguf.quants.dequantize(tensors[f"blk.0.ffn_{p}.weight"].data, tensors[f"blk.0.ffn_{p}.weight"].tensor_type)
                               for p in ("gate", "up")])
        got = unpack(layer.qweight, layer.method.bits, 32)[:want.shape[0]]
        assert torch.equal(got, torch.from_numpy(want)), qtype


def test_narrow_value_heads_load_out_proj_float(tmp_path):
    """Value heads of 16 columns: the converter's tiling moves half blocks, so out_proj loads
    dequantized (float); the rest stays quantized and the run is the dequantized one's."""
    ckpt = make_spec_checkpoint(tmp_path / "hf", "qwen3_5", embed_scale=1.6)
    engine = _engine(write_gguf(ckpt, tmp_path / "q.gguf", "Q8_0"))
    layers = dict(engine.model.named_modules())
    assert not isinstance(layers["layers.0.linear_attn.out_proj"].method, QuantizedLinearMethod)
    assert isinstance(layers["layers.0.linear_attn.in_proj"].method, QuantizedLinearMethod)
    _assert_same_run(greedy_runs(engine), greedy_runs(_engine(write_gguf(ckpt, tmp_path / "d.gguf", "Q8_0", dequantized=True))))


@pytest.fixture(scope="module")
def wide_ckpt(tmp_path_factory):
    """Rows of 256 (K-quants' superblock) in every projection."""
    return make_spec_checkpoint(tmp_path_factory.mktemp("wide"), "qwen3_5", embed_scale=1.6, hidden_size=256,
                                head_dim=64, intermediate_size=256, linear_value_head_dim=64, linear_key_head_dim=64)


@pytest.mark.parametrize("qtype,method", [("Q4_K", "int4"), ("Q6_K", "int8")])
def test_k_quants_are_requantized_as_online_quantization_would(wide_ckpt, tmp_path, qtype, method):
    engine = _engine(write_gguf(wide_ckpt, tmp_path / "k.gguf", qtype))
    assert engine.model.lm_head.method.bits == (4 if method == "int4" else 8)
    online = _engine(write_gguf(wide_ckpt, tmp_path / "d.gguf", qtype, dequantized=True), quantization=method)
    assert greedy_runs(engine) == greedy_runs(online)


def test_a_merged_layer_of_mixed_bits_runs_int8(wide_ckpt, tmp_path):
    """As llama.cpp's Q4_K_M stores attn_v in Q6_K beside Q4_K q and k."""
    engine = _engine(write_gguf(wide_ckpt, tmp_path / "m.gguf", "Q4_K", types={"blk.3.attn_v.weight": "Q6_K"}))
    layers = dict(engine.model.named_modules())
    assert layers["layers.3.self_attn.qkv_proj"].method.bits == 8
    assert layers["layers.0.mlp.gate_up_proj"].method.bits == 4
    assert all(len(tokens) == 12 for tokens, _ in greedy_runs(engine))


def test_tokenizer_from_the_metadata(tmp_path):
    folder = save_checkpoint(make_hf_model("qwen3_5", vocab_size=512), tmp_path / "hf", tokenizer=True)
    path = write_gguf(folder, tmp_path / "m.gguf", tokenizer=True)
    ours, theirs = LLM(model=str(path), dtype="float32"), LLM(model=str(folder), dtype="float32")
    texts = ["def read_config(path):\n    return 1", "Hello  world, ünïcode <|im_start|>user\nhi<|im_end|>"]
    assert [ours.tokenizer.encode(t) for t in texts] == [theirs.tokenizer.encode(t) for t in texts]
    assert ours.tokenizer.eos_token_id == theirs.tokenizer.eos_token_id == ours.engine.model_config.eos_token_id[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got, want = ours.generate(texts, params), theirs.generate(texts, params)
    assert [(o.token_ids, o.text) for o in got] == [(o.token_ids, o.text) for o in want]


def test_cli_takes_a_gguf_file(tmp_path, capsys):
    folder = save_checkpoint(make_hf_model("qwen3_5", vocab_size=512), tmp_path / "hf", tokenizer=True)
    path = write_gguf(folder, tmp_path / "m.gguf", "Q4_0", tokenizer=True)
    assert cli_main(["generate", "--model", str(path), "--max-tokens", "4", "--temperature", "0", "hello"]) in (0, None)
    assert capsys.readouterr().out.strip()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp("small"), "qwen3_5")


@pytest.mark.parametrize("write,match", [
    (dict(qtype="Q8_0", types={"blk.1.attn_qkv.weight": "Q5_0"}), r"tensor blk\.1\.attn_qkv\.weight is of type Q5_0"),
    (dict(drop=("blk.2.ssm_out.weight",)), r"missing 1 tensor\(s\): blk\.2\.ssm_out\.weight \(layers\.2\.linear_attn\.out_proj"),
    (dict(architecture="llama"), r"general\.architecture is 'llama'"),
], ids=["unsupported-type", "missing-tensor", "wrong-architecture"])
def test_broken_files_name_the_tensor_or_key(small, tmp_path, write, match):
    path = write_gguf(small, tmp_path / "bad.gguf", **write)
    with pytest.raises(CheckpointError, match=match):
        _engine(path)


def test_truncated_file_names_the_tensor(small, tmp_path):
    path = write_gguf(small, tmp_path / "t.gguf")
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match=r"tensor \S+ ends at byte \d+, past the file's end .* truncated"):
        _engine(path)


def test_missing_metadata_key_is_named(small, tmp_path, monkeypatch):
    import gguf
    monkeypatch.setattr(gguf.GGUFWriter, "add_ssm_group_count", lambda self, n: None)
    path = write_gguf(small, tmp_path / "k.gguf")
    with pytest.raises(CheckpointError, match=r"metadata key qwen35\.ssm\.group_count is missing"):
        _engine(path)
