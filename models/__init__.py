"""Model side: config parsing, layers, the hybrid causal LM, its MTP head and the loader."""

from .batch import ForwardBatch, LayerCaches
from .config import ConfigError, ModelConfig, load_config, parse_config
from .qwen3_5 import HybridForCausalLM
from .load import checkpoint_shapes, load_model

__all__ = ["ConfigError", "ForwardBatch", "HybridForCausalLM", "LayerCaches", "ModelConfig",
           "checkpoint_shapes", "load_config", "load_model", "parse_config"]
