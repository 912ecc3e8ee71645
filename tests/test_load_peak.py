"""Online quantization's peak while loading: each projection is quantized as soon as its last
tensor has arrived (models/load.py), so the float model never exists whole. Counted in live
tensor bytes (every tensor Python can reach, the loader's own included), not in time."""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys

import pytest
import torch

from hybrid_engine.kernels.linear import LinearMethod
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod
from hybrid_engine.models import HybridForCausalLM, checkpoint_shapes, load_model, parse_config
from hybrid_engine.quantization import QuantizedLayers, Quantization

from checkpoints import write_tensors

# Small, but with the proportions of a real model: the projections hold nearly all the bytes, and
# no one of them more than a tenth (a model held whole shows as its full size).
CONFIG = {
    "model_type": "qwen3_5_text", "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 8, "full_attention_interval": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": True, "max_position_embeddings": 4096, "mtp_num_hidden_layers": 1,
    "rms_norm_eps": 1e-6, "eos_token_id": 0,
}


def _live_tensor_bytes() -> int:
    """Bytes of every distinct storage behind a tensor or parameter that Python can reach (meta
    ones hold none). Exact types: subclasses such as the fake tensors an earlier compiled test
    left behind have no storage to count, and type() makes no lazy object resolve __class__."""
    storages = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and not obj.is_meta:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    """A float32 checkpoint of CONFIG, and its tensors' bytes in float32."""
    folder = tmp_path_factory.mktemp("peak")
    with torch.device("meta"):
        model = HybridForCausalLM(parse_config(CONFIG), with_mtp=True)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, shape in checkpoint_shapes(model).items():
        t = torch.randn(shape, generator=gen) * (0.05 if len(shape) > 1 else 0.1)
        tensors[name if name.startswith("mtp.") else f"model.{name}"] = t
    write_tensors(folder, tensors)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return folder, sum(math.prod(t.shape) * 4 for t in tensors.values())


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_online_quantization_never_holds_the_float_model(float_checkpoint, method, monkeypatch):
    folder, float_bytes = float_checkpoint
    peak, calls = [0], [0]
    quantize_layer = QuantizedLinearMethod.process_weights_after_loading

    def counting(self, layer):                 # the float weight of this layer is whole here
        calls[0] += 1
        peak[0] = max(peak[0], _live_tensor_bytes())
        quantize_layer(self, layer)

    monkeypatch.setattr(QuantizedLinearMethod, "process_weights_after_loading", counting)
    gc.collect()
    before = _live_tensor_bytes()
    layers = QuantizedLayers(Quantization(method), LinearMethod(), native=False)
    model, _ = load_model(folder, "float32", with_mtp=True, methods=layers)
    held = _live_tensor_bytes() - before
    quantized = [m for m in model.modules() if isinstance(getattr(m, "method", None), QuantizedLinearMethod)]
    assert calls[0] == len(quantized) == 37     # 4 per layer and in the MTP layer, and the lm_head
    # int4 keeps about 1/7 of float32's bytes, int8 about 1/4; while loading, the quantized layers
    # so far plus one float layer (the whole float model at once would be over 1.0 here)
    assert held < (0.2 if method == "int4" else 0.32) * float_bytes
    assert peak[0] - before < (0.35 if method == "int4" else 0.45) * float_bytes, (peak[0] - before, float_bytes)
    del model


def test_an_eager_engine_never_imports_torch_compile():
    """dynamo and inductor hold about 110 MiB once imported (issue 39's bound after loading): an
    engine that does not compile must not import them, in loading or in its steps."""
    code = ("import sys\nfrom hybrid_engine import LLM, SamplingParams\n"
            "llm = LLM(quantization='int4', speculative_config={'method': 'mtp', 'num_speculative_tokens': 2})\n"
            "llm.generate(['def f():', [1, 2, 3]], SamplingParams(max_tokens=4))\n"
            "print(sorted(m for m in sys.modules if m.startswith(('torch._dynamo', 'torch._inductor'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
