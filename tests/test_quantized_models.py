"""Online quantization (LLM(quantization=...), hybrid_engine/quantization.py) through whole engines:
a quantized model runs its float checkpoint's dequantized weights (the ground truth: the plain
path on a checkpoint the test writes with every quantized tensor replaced by its dequantized
values), and the native kernel gives the torch reference's results; for all three families,
with MTP k=2, prefix hits and chunked prefill, in float32."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.kernels.backends import native_cpu_available
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod, dequantize, quantize

from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
SHARED = [(7 * i + 3) % 200 + 1 for i in range(12)]
PROMPTS = [SHARED + [5, 6], SHARED + [9, 1, 4], [(5 * i) % 190 + 2 for i in range(37)], [11, 12]]
# the checkpoint tensors online quantization quantizes (hybrid_engine/quantization.py): every
# projection but GDN's b / a (in_proj_ba), mtp.fc, the router and the experts
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj",
             "gate_proj", "up_proj", "down_proj", "lm_head")

needs_native = pytest.mark.skipif(not native_cpu_available(), reason="no native kernels at this CPU level")


def _quantized_by_online_quantization(name: str) -> bool:
    module = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and module in QUANTIZED and ".experts." not in name


def dequantized_checkpoint(src: Path, dst: Path, bits: int, group: int) -> Path:
    """A copy of the float checkpoint `src` whose quantized tensors hold their dequantized values
    (rows are quantized one by one, so a merged or grouped tensor quantizes as its parts do)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if _quantized_by_online_quantization(name):
            tensors[name] = dequantize(quantize(t, bits, group)).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


def _engine(ckpt, backend: str, quantization: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=24, kernel_backend=backend, quantization=quantization,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 2}))


def _run(engine: LLMEngine, max_tokens: int = 10) -> list:
    """Each prompt alone (the shared prefix a hit for the second), then all at once."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    results = {}

    def drain():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out

    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=f"alone{i}")
        drain()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, params, request_id=f"together{i}")
    drain()
    return [(results[rid].token_ids, [lp[t] for lp, t in zip(results[rid].logprobs, results[rid].token_ids)],
             results[rid].num_cached_tokens) for rid in sorted(results)]


def _assert_same(want, got, atol):
    assert any(cached for _, _, cached in want), "the shared prefix never hit"
    for (w_ids, w_lp, w_cached), (g_ids, g_lp, g_cached) in zip(want, got):
        assert g_ids == w_ids and g_cached == w_cached
        torch.testing.assert_close(torch.tensor(g_lp), torch.tensor(w_lp), atol=atol, rtol=0)


@pytest.mark.parametrize("method,bits", [("int8", 8), ("int4", 4)])
def test_quantized_model_runs_its_dequantized_weights(ckpt, tmp_path, method, bits):
    float_run = _engine(dequantized_checkpoint(ckpt, tmp_path / "dq", bits, 32), "torch", None)
    quantized = _engine(ckpt, "torch", method)
    layers = dict(quantized.model.named_modules())
    assert isinstance(layers["layers.0.linear_attn.in_proj"].method, QuantizedLinearMethod)
    assert layers["layers.0.linear_attn.in_proj"].float_tail is not None       # b, a stay float
    assert not isinstance(layers["mtp.fc"].method, QuantizedLinearMethod)
    assert isinstance(layers["lm_head"].method, QuantizedLinearMethod)
    assert isinstance(layers["mtp.layers.0.self_attn.qkv_proj"].method, QuantizedLinearMethod)
    _assert_same(_run(float_run, max_tokens=32), _run(quantized, max_tokens=32), atol=1e-4)


@needs_native
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_quantized_kernel_matches_the_torch_reference(ckpt, method):
    reference, native = _engine(ckpt, "torch", method), _engine(ckpt, "cpu", method)
    assert native.model.lm_head.method.native and not reference.model.lm_head.method.native
    _assert_same(_run(reference), _run(native), atol=1e-4)


def test_tied_embedding_reads_the_quantized_table(tmp_path):
    """The default model ties its embedding to lm_head: the quantized engine frees the float table
    and embeds from lm_head's dequantized rows, which a float run of the dequantized checkpoint
    (its one table dequantized) reproduces token for token."""
    from hybrid_engine.default_model import default_model_path
    src = Path(default_model_path())
    tensors = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    dst = tmp_path / "dq"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    for name, t in tensors.items():
        if _quantized_by_online_quantization(name) or name.endswith("embed_tokens.weight"):
            tensors[name] = dequantize(quantize(t, 4, 32)).to(t.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    quantized = LLM(dtype="float32", quantization="int4", kernel_backend="torch")
    assert quantized.engine.model.embed_tokens.weight.is_meta
    want = LLM(model=str(dst), dtype="float32", kernel_backend="torch").generate(["def read_config(path):"], params)
    got = quantized.generate(["def read_config(path):"], params)
    assert got[0].token_ids == want[0].token_ids


@pytest.mark.parametrize("kwargs,message", [
    (dict(quantization="int3"), "quantization must be one of"),
    (dict(quantization="int4", quantization_group_size=3), "quantization_group_size: group size 3"),
    (dict(quantization="int8", quantization_group_size="32"), "quantization_group_size must be an int"),
    (dict(quantization_group_size=32), "quantization_group_size is set but quantization is None"),
])
def test_bad_quantization_arguments_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs).validate()


def test_a_group_size_that_does_not_divide_keeps_those_layers_float(ckpt, caplog):
    """Groups of 48 divide none of the tiny models' input widths (64, 128, 32): every projection
    stays float, the log names them, and the engine runs."""
    with caplog.at_level(logging.WARNING, logger="hybrid_engine"):
        engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", quantization="int8",
                                        quantization_group_size=48, kernel_backend="torch"))
    layers = [m for m in engine.model.modules() if hasattr(m, "shards")]
    assert layers and not any(isinstance(m.method, QuantizedLinearMethod) for m in layers)
    assert "kept float" in caplog.text and "layers.0." in caplog.text
    engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
