"""A GGUF file's metadata -> our ModelConfig: the keys llama.cpp's converter writes
(Qwen3NextModel.set_gguf_parameters and its bases) turned back into config.json's, then
models/config.py's `parse_config` checks them as it checks any config.json.

    {arch}.block_count                  num_hidden_layers + nextn_predict_layers (the MTP layer)
    {arch}.nextn_predict_layers         mtp_num_hidden_layers (absent: no MTP head)
    {arch}.embedding_length             hidden_size
    {arch}.feed_forward_length          intermediate_size (dense)
    {arch}.expert_count / expert_used_count / expert_feed_forward_length /
      expert_shared_feed_forward_length num_experts / num_experts_per_tok / moe_intermediate_size /
                                        shared_expert_intermediate_size
    {arch}.attention.head_count / head_count_kv / key_length   num_attention_heads / num_key_value_heads / head_dim
    {arch}.attention.layer_norm_rms_epsilon                    rms_norm_eps (a float32 there)
    {arch}.rope.freq_base / rope.dimension_count               rope_theta / partial_rotary_factor x head_dim
    {arch}.ssm.conv_kernel / state_size / group_count / time_step_rank / inner_size
                                        linear_conv_kernel_dim / linear_key_head_dim / linear_num_key_heads /
                                        linear_num_value_heads / linear_value_head_dim x value heads
    {arch}.attention.recurrent_layers   layer_types (else {arch}.full_attention_interval)
    {arch}.context_length               max_position_embeddings
    tokenizer.ggml.eos_token_id         eos_token_id
vocab_size is the embedding's rows, torch_dtype its type where float (else float32); the lm_head is tied when the file has no output.weight;
Qwen3-Next's dense-MLP layers (mlp_only_layers) are those without a router (ffn_gate_inp).
"""

from __future__ import annotations

import numpy as np

from hybrid_engine.models.config import CheckpointError, ConfigError, ModelConfig, parse_config

from .gguf_layout import ARCHITECTURES


# dtype="auto" loads a float file in the embedding's own float type (config.json's torch_dtype)
TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def model_config(metadata: dict, tensor_shapes: dict[str, tuple[int, ...]], where: str,
                 embedding_type: str | None = None) -> ModelConfig:
    """metadata: key -> value (gguf's field contents); tensor_shapes: GGUF name -> torch-order
    shape; embedding_type: token_embd's GGUF type name."""
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: general.architecture is {arch!r}; this engine reads "
                              f"{', '.join(map(repr, ARCHITECTURES))}")

    def key(name: str, default=None, required: bool = True):
        full = f"{arch}.{name}"
        if full in metadata:
            return metadata[full]
        if required and default is None:
            raise CheckpointError(f"{where}: metadata key {full} is missing")
        return default

    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError(f"{where}: tensor token_embd.weight is missing")
    mtp_layers = key("nextn_predict_layers", 0)
    layers = key("block_count") - mtp_layers
    heads_v = key("ssm.time_step_rank")
    head_dim = key("attention.key_length")
    raw = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": tensor_shapes["token_embd.weight"][0],
        "hidden_size": key("embedding_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": key("attention.head_count"),
        "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": head_dim,
        "rope_theta": key("rope.freq_base"),
        "partial_rotary_factor": key("rope.dimension_count") / head_dim,
        # stored as float32: its shortest decimal gives config.json's value (1e-06, not 9.99e-07)
        "rms_norm_eps": float(np.format_float_positional(np.float32(key("attention.layer_norm_rms_epsilon")))),
        "linear_conv_kernel_dim": key("ssm.conv_kernel"),
        "linear_key_head_dim": key("ssm.state_size"),
        "linear_num_key_heads": key("ssm.group_count"),
        "linear_num_value_heads": heads_v,
        "linear_value_head_dim": key("ssm.inner_size") // heads_v,
        "max_position_embeddings": key("context_length", 32768, required=False),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "mtp_num_hidden_layers": mtp_layers,
        "torch_dtype": TORCH_DTYPES.get(embedding_type),
    }
    recurrent = key("attention.recurrent_layers", required=False)
    if recurrent is not None:
        raw["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]]
    else:
        raw["full_attention_interval"] = key("full_attention_interval", 4)
    if arch == "qwen35":
        raw["intermediate_size"] = key("feed_forward_length")
    else:
        raw.update(num_experts=key("expert_count"), num_experts_per_tok=key("expert_used_count"),
                   moe_intermediate_size=key("expert_feed_forward_length"),
                   shared_expert_intermediate_size=key("expert_shared_feed_forward_length", 0, required=False))
    if arch == "qwen3next":
        raw["intermediate_size"] = key("feed_forward_length", raw["moe_intermediate_size"], required=False)
        raw["mlp_only_layers"] = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_shapes]
    eos = metadata.get("tokenizer.ggml.eos_token_id")
    if eos is not None:
        raw["eos_token_id"] = eos
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
