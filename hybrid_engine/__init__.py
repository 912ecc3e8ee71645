"""hybrid-engine: an inference engine for Qwen3.5-style hybrid (GDN + gated attention + MTP) models.

The public names are imported on first use (PEP 562), so that `import hybrid_engine.cli`, the
console script's entry point, starts without torch: the CLI's main() then runs every heavy
import inside its own error handling, and Ctrl-C during start-up is a clean "interrupted".
"""

from importlib import import_module

_EXPORTS = {"LLM": ".llm", "LLMEngine": ".engine", "EngineConfig": ".config",
            "RequestOutput": ".outputs", "SamplingParams": ".sampling_params",
            "StructuredOutputsParams": ".structured_outputs",
            "EngineDeadError": ".engine", "StepFailedError": ".engine"}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value
