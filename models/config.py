"""Model configuration: one dataclass for every supported family, parsed from config.json.

Supported `model_type`s: `qwen3_5` (VLM wrapper, text under `text_config`), `qwen3_5_text`,
`qwen3_5_moe` / `qwen3_5_moe_text` and `qwen3_next`. Defaults follow the transformers
config classes (QWEN35_REFERENCE.md §1), not any one checkpoint.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")

_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
          "linear_num_value_heads")
_MOE_SIZES = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
REQUIRED_KEYS = {"qwen3_5": _SIZES + ("intermediate_size",), "qwen3_5_moe": _SIZES + _MOE_SIZES,
                 "qwen3_next": _SIZES + ("intermediate_size",) + _MOE_SIZES}

LINEAR = "linear_attention"
FULL = "full_attention"


class CheckpointError(ValueError):
    """A model folder the engine cannot load: its config.json or its weights."""


class ConfigError(CheckpointError):
    """A config.json the engine cannot serve."""


@dataclass
class ModelConfig:
    family: str  # "qwen3_5" | "qwen3_5_moe" | "qwen3_next"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # mlp / moe
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # misc
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    # None: config.json does not say (the head is whatever mtp.* weights the checkpoint holds);
    # 0: no MTP head, whatever the weights; 1: one MTP layer, the only depth the engine runs.
    mtp_num_hidden_layers: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    is_vlm_wrapper: bool = False

    # ---- derived sizes -------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL]

    @property
    def linear_attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR]

    def layer_is_moe(self, layer_idx: int) -> bool:
        """Which MLP a decoder layer (or the MTP layer, index -1 => same rule as family) uses."""
        if self.num_experts <= 0:
            return False
        if self.family == "qwen3_5_moe":
            return True
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


def _int(key: str, value, minimum: int) -> int:
    # bool is an int in Python, but `true` as a head count is a broken config.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{key} must be an int >= {minimum}, got {value!r}")
    return value


def _real(key: str, value, allowed: str, ok) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ConfigError(f"{key} must be {allowed}, got {value!r}")
    return float(value)


def _token_ids(key: str, value, vocab_size: int) -> list[int]:
    ids = [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise ConfigError(f"{key} must be a token id or a list of token ids in [0, {vocab_size}), "
                              f"got {value!r}")
    return ids


def parse_config(raw: dict) -> ModelConfig:
    """Turn a config.json dict into a ModelConfig, or raise ConfigError naming the key, its
    value and what is allowed."""
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    is_vlm = model_type in ("qwen3_5", "qwen3_5_moe")
    text = raw
    if is_vlm:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"model_type {model_type!r} needs a 'text_config' object")
    family = {"qwen3_5": "qwen3_5", "qwen3_5_text": "qwen3_5", "qwen3_5_moe": "qwen3_5_moe",
              "qwen3_5_moe_text": "qwen3_5_moe", "qwen3_next": "qwen3_next"}[model_type]
    # The sizes transformers' config classes default to one particular model (a 9B-style
    # Qwen3.5, QWEN35_REFERENCE.md §1): a config.json without one describes some other model,
    # and taking the default would only fail later, blaming a tensor's shape. transformers'
    # save_pretrained writes every one of them, default or not.
    required = REQUIRED_KEYS[family]
    missing = [key for key in required if key not in text and key not in raw]
    if missing:
        raise ConfigError(f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; "
                          "the model's sizes have no default")

    def get(key, default=None):
        if key in text:
            return text[key]
        if key in raw:  # some VLM wrappers keep keys (e.g. tie_word_embeddings) at the top level
            return raw[key]
        return default

    def count(key, default=None, minimum=1) -> int:
        value = get(key, default)
        return 0 if value is None and minimum == 0 else _int(key, value, minimum)

    n_layers = count("num_hidden_layers")
    layer_types = get("layer_types")
    if layer_types is None:
        interval = count("full_attention_interval", 4)
        layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
    if (not isinstance(layer_types, list) or len(layer_types) != n_layers
            or any(t not in (LINEAR, FULL) for t in layer_types)):
        raise ConfigError(
            f"layer_types must list {n_layers} entries of {LINEAR!r}/{FULL!r}, got {layer_types!r}"
        )
    rope = get("rope_parameters") or get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters must be an object, got {rope!r}")
    rope_theta = _real("rope_theta", rope.get("rope_theta", get("rope_theta", 10000.0)), "a number > 0",
                       lambda v: v > 0)
    partial = _real("partial_rotary_factor", rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25)),
                    "a number in (0, 1]", lambda v: 0 < v <= 1)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "mrope"):
        raise ConfigError(f"unsupported rope_type {rope_type!r} (only 'default' is implemented)")
    # A VLM wrapper's own (top-level) key decides tying, as in transformers: save_pretrained of a
    # tied Qwen3_5ForConditionalGeneration writes top-level true but text_config false.
    if is_vlm and raw.get("tie_word_embeddings") is not None:
        tie = raw["tie_word_embeddings"]
    else:
        tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    if not isinstance(tie, bool):
        raise ConfigError(f"tie_word_embeddings must be true or false, got {tie!r}")
    vocab_size = count("vocab_size")
    eos = text.get("eos_token_id")
    eos = _token_ids("eos_token_id", eos if eos is not None else raw.get("eos_token_id"), vocab_size)
    torch_dtype = get("torch_dtype") or get("dtype")
    if torch_dtype is not None and not isinstance(torch_dtype, str):
        raise ConfigError(f"torch_dtype must be a str such as 'bfloat16', got {torch_dtype!r}")
    num_experts = count("num_experts", 0, minimum=0)
    moe = num_experts > 0
    cfg = ModelConfig(
        family=family,
        vocab_size=vocab_size,
        hidden_size=count("hidden_size"),
        num_hidden_layers=n_layers,
        layer_types=layer_types,
        num_attention_heads=count("num_attention_heads"),
        num_key_value_heads=count("num_key_value_heads"),
        head_dim=count("head_dim", 256),
        rope_theta=rope_theta,
        partial_rotary_factor=partial,
        linear_num_key_heads=count("linear_num_key_heads", 16),
        linear_num_value_heads=count("linear_num_value_heads"),
        linear_key_head_dim=count("linear_key_head_dim", 128),
        linear_value_head_dim=count("linear_value_head_dim", 128),
        # The conv window keeps K-1 past inputs; K = 1 would keep none.
        linear_conv_kernel_dim=count("linear_conv_kernel_dim", 4, minimum=2),
        intermediate_size=count("intermediate_size", 0, minimum=1 if family == "qwen3_5" else 0),
        num_experts=num_experts,
        num_experts_per_tok=count("num_experts_per_tok", 0, minimum=1 if moe else 0),
        moe_intermediate_size=count("moe_intermediate_size", 0, minimum=1 if moe else 0),
        shared_expert_intermediate_size=count("shared_expert_intermediate_size", 0, minimum=0),
        norm_topk_prob=bool(get("norm_topk_prob", True)) if family == "qwen3_next" else True,
        decoder_sparse_step=count("decoder_sparse_step", 1),
        mlp_only_layers=_mlp_only_layers(get("mlp_only_layers"), n_layers),
        rms_norm_eps=_real("rms_norm_eps", get("rms_norm_eps", 1e-6), "a number > 0", lambda v: v > 0),
        tie_word_embeddings=tie,
        # A request holds its prompt and at least one generated token.
        max_position_embeddings=count("max_position_embeddings", 32768, minimum=2),
        mtp_num_hidden_layers=_mtp_layers(get("mtp_num_hidden_layers")),
        eos_token_id=eos,
        torch_dtype=torch_dtype,
        is_vlm_wrapper=is_vlm,
    )
    if cfg.num_experts_per_tok > cfg.num_experts:
        raise ConfigError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) must be <= num_experts "
                          f"({cfg.num_experts})")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.rotary_dim < 2 or cfg.rotary_dim % 2:
        raise ConfigError(f"rotary dim {cfg.rotary_dim} (head_dim * partial_rotary_factor) must be even and >= 2")
    _check_weight_sizes(cfg)
    return cfg


MAX_WEIGHT_ELEMENTS = 1 << 40        # 4 TB of float32 in one weight: far above any real model's


def _check_weight_sizes(cfg: ModelConfig) -> None:
    """Sizes whose weights could not exist are a broken config. Without this check the model's
    construction fails with torch's overflow error (a RuntimeError) even on the meta device."""
    lk, lv = cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim
    shapes = {
        "the embedding (vocab_size x hidden_size)": (cfg.vocab_size, cfg.hidden_size),
        "q_proj (num_attention_heads x head_dim x 2, hidden_size)": (cfg.num_attention_heads * cfg.head_dim * 2,
                                                                      cfg.hidden_size),
        "k_proj (num_key_value_heads x head_dim, hidden_size)": (cfg.num_key_value_heads * cfg.head_dim,
                                                                 cfg.hidden_size),
        "in_proj_qkvz (linear heads x dims, hidden_size)": (2 * lk + 2 * lv, cfg.hidden_size),
        "conv1d (linear heads x dims, linear_conv_kernel_dim)": (2 * lk + lv, cfg.linear_conv_kernel_dim),
        "the MLP (intermediate_size x 2, hidden_size)": (2 * cfg.intermediate_size, cfg.hidden_size),
        "the experts (num_experts x moe_intermediate_size x 2, hidden_size)": (
            2 * cfg.num_experts * cfg.moe_intermediate_size, cfg.hidden_size),
        "the shared expert (shared_expert_intermediate_size x 2, hidden_size)": (
            2 * cfg.shared_expert_intermediate_size, cfg.hidden_size),
    }
    for name, (rows, cols) in shapes.items():
        if rows * cols > MAX_WEIGHT_ELEMENTS:
            raise ConfigError(f"{name} would be a {rows} x {cols} weight, more than {MAX_WEIGHT_ELEMENTS} elements: "
                              "the config's sizes are broken")


def _mtp_layers(value) -> int | None:
    if value is None:
        return None
    layers = _int("mtp_num_hidden_layers", value, 0)
    if layers > 1:
        raise ConfigError(f"mtp_num_hidden_layers {layers} is not supported: the engine runs an MTP head of "
                          "one layer (set 1, or 0 for no MTP head)")
    return layers


def _mlp_only_layers(value, n_layers: int) -> list[int]:
    layers = value or []
    if not isinstance(layers, list) or any(isinstance(i, bool) or not isinstance(i, int)
                                           or not 0 <= i < n_layers for i in layers):
        raise ConfigError(f"mlp_only_layers must be a list of layer indices in [0, {n_layers}), got {value!r}")
    return layers


def load_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"model folder not found: {folder}")
    path = folder / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in model folder {folder}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read {path}: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} does not hold a JSON object")
    try:
        return parse_config(raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
