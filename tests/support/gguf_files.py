"""Tiny GGUF files written as llama.cpp's converter writes them (convert_hf_to_gguf.py for
Qwen3.5 / Qwen3.5-MoE / Qwen3-Next, then llama-quantize's choice of types), from our tiny HF
checkpoints: the forward direction of hybrid_engine/checkpoint_formats/gguf_layout.py.

    write_gguf(folder, path, "Q4_0")                     # every 2-D / 3-D weight in Q4_0
    write_gguf(folder, path, "Q8_0", dequantized=True)   # the same values, stored F32: the reference

K-quants (Q4_K, Q6_K) are random valid blocks (gguf's Python package cannot quantize to them).
Kept F32 as the converter keeps them: 1-D tensors, norms, conv1d, the routers
(ffn_gate_inp, ffn_gate_inp_shexp). `types` overrides a GGUF tensor's type by name.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from hybrid_engine.checkpoint_formats.gguf_layout import (EXPERT_GATE, EXPERT_UP, QWEN3NEXT_BA, VHeadOrder, gguf_name,
                                                          to_gguf)
from hybrid_engine.models.config import load_config
from hybrid_engine.models.load import checkpoint_shapes
from hybrid_engine.models.loader import load_weights
from hybrid_engine.models.qwen3_5 import HybridForCausalLM

ARCH = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
ALWAYS_F32 = ("_norm.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def gguf_tensors(folder: Path) -> tuple[object, str, dict[str, torch.Tensor]]:
    """(config, arch, GGUF name -> float32 tensor as the converter stores it)."""
    cfg = load_config(folder)
    arch = ARCH[cfg.family]
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=True)
    expected = checkpoint_shapes(model)
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    ours = dict(load_weights(folder, cfg, expected, torch.float32))
    heads = None if arch == "qwen3next" else VHeadOrder(cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                                                        cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    out = {}
    for name, t in ours.items():
        gname = gguf_name(name, cfg.num_hidden_layers)
        block = gname.rpartition(".")[0].rpartition(".")[0]
        if name.endswith("experts.gate_up_proj"):
            gate, up = t.float().chunk(2, dim=1)
            out[f"{block}.{EXPERT_GATE}"], out[f"{block}.{EXPERT_UP}"] = gate, up
        elif arch == "qwen3next" and name.endswith("in_proj_b.weight"):
            a = ours[name.replace("in_proj_b", "in_proj_a")]
            hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
            grouped = torch.cat([t.view(hk, r, -1), a.view(hk, r, -1)], dim=1)   # per key head: [b | a]
            out[f"{block}.{QWEN3NEXT_BA}"] = grouped.reshape(2 * hk * r, -1).float()
        elif arch == "qwen3next" and name.endswith("in_proj_a.weight"):
            continue
        else:
            out[gname] = to_gguf(name, t, heads)
    return cfg, arch, out


def _type(gname: str, t: torch.Tensor, qtype: str, types: dict[str, str]) -> str:
    """llama-quantize's choice, simplified: qtype where the rows are whole blocks of it."""
    import gguf
    if gname in types:
        return types[gname]
    if t.dim() < 2 or gname.endswith(ALWAYS_F32) or qtype == "F32":
        return "F32"
    block, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    return "F32" if t.shape[-1] % block else qtype


def write_gguf(folder: Path, path: Path, qtype: str = "F32", dequantized: bool = False,
               types: dict[str, str] | None = None, drop: tuple[str, ...] = (), tokenizer: bool = False,
               architecture: str | None = None) -> Path:
    """Write `folder`'s checkpoint to `path` with the 2-D / 3-D weights in `qtype`; dequantized:
    store the quantized values as F32 instead (the float reference of the same weights).
    drop: GGUF tensors left out; architecture: general.architecture written instead of the family's."""
    import gguf
    cfg, arch, tensors = gguf_tensors(Path(folder))
    w = gguf.GGUFWriter(str(path), architecture or arch)
    arch = architecture or arch
    w.add_block_count(cfg.num_hidden_layers + (cfg.mtp_num_hidden_layers or 0))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.rotary_dim)
    if cfg.mtp_num_hidden_layers:
        w.add_nextn_predict_layers(cfg.mtp_num_hidden_layers)
    w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
    w.add_ssm_state_size(cfg.linear_key_head_dim)
    w.add_ssm_group_count(cfg.linear_num_key_heads)
    w.add_ssm_time_step_rank(cfg.linear_num_value_heads)
    w.add_ssm_inner_size(cfg.linear_value_head_dim * cfg.linear_num_value_heads)
    recurrent = [t == "linear_attention" for t in cfg.layer_types] + [False] * (cfg.mtp_num_hidden_layers or 0)
    w.add_array(f"{arch}.attention.recurrent_layers", recurrent)
    w.add_full_attention_interval(4)
    if cfg.family == "qwen3_5" or cfg.family == "qwen3_next":
        w.add_feed_forward_length(cfg.intermediate_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if tokenizer:
        _add_tokenizer(w, Path(folder))
    for gname, t in tensors.items():
        if gname in drop:
            continue
        kind = _type(gname, t, qtype, types or {})
        data = t.numpy().astype(np.float32)
        if kind == "F32":
            w.add_tensor(gname, data)
            continue
        qt = gguf.GGMLQuantizationType[kind]
        blocks = _k_quant_blocks(data.shape, qt, gname) if kind in K_SCALES else gguf.quants.quantize(data, qt)
        if dequantized:
            w.add_tensor(gname, gguf.quants.dequantize(blocks, qt).astype(np.float32))
        else:
            w.add_tensor(gname, blocks, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# gguf's Python package does not quantize to K-quants: such tensors get random blocks with these
# superblock scales (byte offsets of d / dmin as float16), whose dequantized weights stay small.
K_SCALES = {"Q4_K": {0: 2e-4, 2: 2e-4}, "Q6_K": {208: 2e-5}}


def _k_quant_blocks(shape: tuple[int, ...], qt, name: str) -> np.ndarray:
    import zlib
    import gguf
    block, size = gguf.GGML_QUANT_SIZES[qt]
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for offset, scale in K_SCALES[qt.name].items():
        blocks[..., offset:offset + 2] = np.frombuffer(np.float16(scale).tobytes(), dtype=np.uint8)
    return blocks.reshape(*shape[:-1], -1)


def _add_tokenizer(w, folder: Path) -> None:
    """tokenizer.json's byte-level BPE as the converter stores it (llama.cpp's gpt2 model)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    special = {t["content"]: t["id"] for t in data["added_tokens"]}
    vocab.update(special)
    tokens = [None] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen35")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    merges = data["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    eos = json.loads((folder / "config.json").read_text())["eos_token_id"]
    w.add_eos_token_id(eos)
