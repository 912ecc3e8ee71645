"""hybrid-engine: an inference engine for Qwen3.5-style hybrid (GDN + gated attention + MTP) models."""

from .config import EngineConfig
from .engine import LLMEngine
from .llm import LLM
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "RequestOutput", "SamplingParams"]
