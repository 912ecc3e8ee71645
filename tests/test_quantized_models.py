"""Online quantization (LLM(quantization=...), hybrid_engine/quantization.py) through whole engines:
a quantized model runs its float checkpoint's dequantized weights (the ground truth: the plain
path on a checkpoint the test writes with every quantized tensor replaced by its dequantized
values), and the native kernel gives the torch reference's results; for all three families,
with MTP k=2, prefix hits and chunked prefill, in float32."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybrid_engine import LLM, EngineConfig, LLMEngine, SamplingParams
from hybrid_engine.kernels.backends import native_cpu_available
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod, dequantize, quantize

from engine_checks import run_alone_then_together
from quantized_checkpoints import dequantized_copy
from spec_models import make_spec_checkpoint

FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# the checkpoint tensors online quantization quantizes (hybrid_engine/quantization.py): every
# projection (the experts' too) but GDN's b / a (in_proj_ba), mtp.fc and the router
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_qkvz", "out_proj",
             "gate_proj", "up_proj", "down_proj", "lm_head")

needs_native = pytest.mark.skipif(not native_cpu_available(), reason="no native kernels at this CPU level")


def _quantized_by_online_quantization(name: str) -> bool:
    module = name.removesuffix(".weight").rpartition(".")[2]
    return name.endswith(".weight") and module in QUANTIZED          # experts too, each on its own


def dequantized_checkpoint(src: Path, dst: Path, bits: int, group: int) -> Path:
    """A copy of the float checkpoint `src` whose tensors online quantization quantizes hold their
    dequantized values (the lm_head's too: untied, it runs at the scheme's bits)."""
    def bits_of(name: str) -> int | None:
        return bits if _quantized_by_online_quantization(name) else None
    return dequantized_copy(src, dst, bits_of, group)


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    return make_spec_checkpoint(tmp_path_factory.mktemp(request.param), request.param, embed_scale=1.6)


def _engine(ckpt, backend: str, quantization: str | None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=4,
                                  max_num_batched_tokens=24, kernel_backend=backend, quantization=quantization,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 2}))




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
    assert isinstance(layers["lm_head"].method, QuantizedLinearMethod) and layers["lm_head"].method.bits == bits
    assert layers["lm_head"].row_table is None                        # untied: no lookups to serve
    assert isinstance(layers["mtp.layers.0.self_attn.qkv_proj"].method, QuantizedLinearMethod)
    if "layers.0.mlp.experts" in layers:
        experts = layers["layers.0.mlp.experts"]
        assert not hasattr(experts, "gate_up_proj") and isinstance(experts.per_expert[0].down_proj.method, QuantizedLinearMethod)
    _assert_same(run_alone_then_together(float_run, max_tokens=32), run_alone_then_together(quantized, max_tokens=32),
                 atol=1e-4)


def _int8_activation_reference(monkeypatch):
    """Engines built after this run their quantized layers by the torch reference of the native
    kernel's steps (x rounded to int8 as it rounds it), everything else as before."""
    from hybrid_engine import engine as engine_module, quantization

    def layers(config, float_method, kernels, gguf_file=None):
        scheme = quantization.parse_quantization(config.quantization, config.quantization_group_size)
        return quantization.QuantizedLayers(scheme, float_method, native=False, int8_activations=True)
    monkeypatch.setattr(engine_module, "quantized_layers", layers)


@needs_native
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_quantized_kernel_matches_its_torch_reference(ckpt, method, monkeypatch):
    """The cpu backend's engine with the native kernel and with its torch reference in the same
    places: the same bits, so the same tokens and logprobs. (Against the torch backend's engine
    the comparison would not hold at 1e-4: the other kernels' float32 rounding differences flip
    some of x's int8 roundings, and the quantized model amplifies each flip.)"""
    native = _engine(ckpt, "cpu", method)
    _int8_activation_reference(monkeypatch)
    reference = _engine(ckpt, "cpu", method)
    assert native.model.lm_head.method.native and not reference.model.lm_head.method.native
    assert reference.model.lm_head.method.int8_activations
    _assert_same(run_alone_then_together(reference), run_alone_then_together(native), atol=0)


@needs_native
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_quantized_mtp_is_lossless(ckpt, method):
    """Greedy tokens with MTP k=2 equal those without: each row's product is the same whichever
    rows share its step (the kernel rounds x per row, and the float tail shards run the backend's
    blocked product, not MKL's, whose sums change with the rows)."""
    def run(k):
        engine = LLMEngine(EngineConfig(model=str(ckpt), dtype="float32", block_size=4, max_num_seqs=4,
                                        max_num_batched_tokens=24, quantization=method,
                                        speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None))
        return [ids for ids, _, _ in run_alone_then_together(engine, max_tokens=16)]
    assert run(2) == run(0)


@needs_native
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_native_quantized_mtp_is_lossless_on_the_default_model(method):
    """The same on the default model's own prompts at k = 1 and 3, logprobs bit for bit too (a tail
    product through MKL once moved them by 1e-2, and x's int8 rounding turned that into other
    tokens for one prompt)."""
    from hybrid_engine.cli.bench import BUILTIN_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=1)

    def run(k):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        outs = LLM(dtype="float32", quantization=method, speculative_config=spec).generate(BUILTIN_PROMPTS, params)
        return [(o.token_ids, o.logprobs) for o in outs]
    without = run(0)
    assert run(1) == without and run(3) == without


@needs_native
@pytest.mark.slow
def test_compiled_int4_steps_match_eager_on_the_default_model():
    """Compiled decode and MTP steps of the tied int4 default model (its lm_head's largest logits
    scored again from the int8 rows inside the graph) give the eager engine's greedy tokens.
    Minutes on 2 cores: `-m slow`."""
    from hybrid_engine.cli.bench import BUILTIN_PROMPTS
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(compiled, k):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        llm = LLM(dtype="float32", quantization="int4", speculative_config=spec, enable_torch_compile=compiled)
        return [o.token_ids for o in llm.generate(BUILTIN_PROMPTS[:4], params)]
    eager = run(False, 0)
    assert run(True, 0) == eager and run(True, 2) == eager


DEFAULT_PROMPTS = ["def read_config(path):", "import os\nimport sys\n", "class Node:\n    def __init__(self",
                   "for i in range(10):", "    return sorted(", "# Compute the mean\ndef mean(xs):",
                   "with open(path) as f:", "if __name__ == '__main__':"]


def _next_token_logprobs(**llm_kwargs) -> list[dict[int, float]]:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    return [o.logprobs[0] for o in LLM(dtype="float32", **llm_kwargs).generate(DEFAULT_PROMPTS, params)]


def _distance(want: dict[int, float], got: dict[int, float]) -> tuple[float, float]:
    """(KL over the top tokens both list, largest logprob gap among tokens of p > e^-5)."""
    shared = [t for t in want if t in got]
    kl = sum(math.exp(want[t]) * (want[t] - got[t]) for t in shared)
    return kl, max(abs(want[t] - got[t]) for t in shared if want[t] > -5)


@needs_native
def test_int8_activations_cost_little_on_the_default_model():
    """What rounding x to int8 costs, stated: on the default (trained) model, the next-token
    distribution after eight prompts, the native int8 model (x rounded) against the float model
    and against the same int8 weights with float x (the torch reference). Measured 2026-12-06:
    |KL| <= 0.003 and top-token logprobs within 0.05 of float, 0.03 of the float-x reference."""
    float_lp = _next_token_logprobs()
    native = _next_token_logprobs(quantization="int8")
    float_x = _next_token_logprobs(quantization="int8", kernel_backend="torch")
    for f, n, r in zip(float_lp, native, float_x):
        kl, gap = _distance(f, n)
        assert abs(kl) < 0.01 and gap < 0.1, (kl, gap)
        assert max(f, key=f.get) == max(n, key=n.get)
        assert _distance(r, n)[1] < 0.1


def test_tied_embedding_reads_its_own_int8_rows(tmp_path):
    """The default model ties its embedding to lm_head: under int4 the quantized engine frees the
    float table, runs lm_head's product on int4 and embeds from int8 rows of the same table
    (hybrid_engine/quantization.py), which a float run of the checkpoint untied, its lm_head
    the int4-dequantized table and its embedding the int8-dequantized one, reproduces token
    for token."""
    from hybrid_engine.default_model import default_model_path
    src = Path(default_model_path())
    tensors = load_file(str(src / "model.safetensors"))
    assert "lm_head.weight" not in tensors
    dst = tmp_path / "dq"
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and f.suffix not in (".safetensors", ".json"):
            (dst / f.name).write_bytes(f.read_bytes())
    for f in src.glob("*.json"):
        (dst / f.name).write_text(f.read_text().replace('"tie_word_embeddings": true', '"tie_word_embeddings": false'))
    assert '"tie_word_embeddings": false' in (dst / "config.json").read_text()
    (embed_name,) = [name for name in tensors if name.endswith("embed_tokens.weight")]
    table = tensors[embed_name]
    for name, t in tensors.items():
        if _quantized_by_online_quantization(name):
            tensors[name] = dequantize(quantize(t, 4, 32)).to(t.dtype)
    tensors[embed_name] = dequantize(quantize(table, 8, 32)).to(table.dtype)
    tensors["lm_head.weight"] = dequantize(quantize(table, 4, 32)).to(table.dtype)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    quantized = LLM(dtype="float32", quantization="int4", kernel_backend="torch")
    lm_head = quantized.engine.model.lm_head
    assert quantized.engine.model.embed_tokens.weight.is_meta
    assert lm_head.method.bits == 4 and lm_head.row_table is not None
    untied = LLM(model=str(dst), dtype="float32", kernel_backend="torch")
    assert not untied.engine.model.embed_tokens.weight.is_meta
    want = untied.generate(["def read_config(path):"], params)
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
