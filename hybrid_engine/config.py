"""Engine configuration: what LLM(...) accepts, validated up front."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    block_size: int = 16
    # None: as many as cache_memory_bytes holds at DEFAULT_KV_TOKENS_PER_SEQ tokens each (at most
    # 256), or 64 without a budget (hybrid_engine/cache_sizing.py derive_max_num_seqs).
    max_num_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    cache_memory_bytes: int | None = None
    max_model_len: int | None = None
    speculative_config: dict | None = None
    device: str = "cpu"
    seed: int = 0
    # The kernel backend (kernels/backends.py): "auto" (triton on CUDA, the native "cpu" kernels
    # where they build for this CPU's level, else "torch"), "torch" (the reference: torch ops
    # only), "cpu" or "triton".
    kernel_backend: str = "auto"
    # Online weight quantization of a float checkpoint at load (hybrid_engine/quantization.py):
    # None, "int8" or "int4", in groups of quantization_group_size input columns (None: 32).
    quantization: str | None = None
    quantization_group_size: int | None = None
    # CUDA only: False captures decode/verify steps as CUDA graphs at start-up (vLLM's flag).
    enforce_eager: bool = False
    cuda_graph_batch_sizes: list[int] | None = None   # None: 1, 2, 4, 8, 16, 32, ... max_num_seqs
    # torch.compile the decode / verify forwards and MTP drafting (hybrid_engine/compiled_steps.py):
    # faster steps after tens of seconds of compiling (SGLang's --enable-torch-compile). Off
    # where CUDA graphs already take those steps.
    enable_torch_compile: bool = False
    # CPU bfloat16: keep a second, blocked copy of the weights for products of 1-4 rows
    # (batch-1 decode, MTP verify), where the native AVX512-BF16 kernel streams faster than
    # oneDNN (models/linear.py); eager and compiled steps both use it. Costs one more bf16
    # weight-size of memory; False saves it.
    bf16_few_rows_copy: bool = True
    # Automatic prefix caching (hybrid_engine/prefix_caching.py): full KV blocks are shared by
    # content and GDN states are checkpointed at block boundaries, so a request whose prompt
    # starts like an earlier one computes only the rest. On by default, as in vLLM.
    enable_prefix_caching: bool = True
    # GDN checkpoints kept (None: 2 per sequence); each costs one state slot plus a hidden
    # vector (about 1,000 tokens of KV at Qwen3.5-0.8B dims), inside cache_memory_bytes.
    prefix_checkpoints: int | None = None
    # Also checkpoint every this many tokens of a prefill (a multiple of block_size; None: no).
    prefix_checkpoint_interval: int | None = None
    # Tensor parallelism (hybrid_engine/tensor_parallel.py): the engine's process and N-1 workers it
    # starts each hold 1/N of the heads (models/parallel.py); CPU, eager, float weights, quantized
    # online (each rank its own part), GGUF files or folders stored quantized (not GPTQ act-order).
    tensor_parallel_size: int = 1

    def validate(self) -> None:
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"model must be a path to a model folder (str) or None, got "
                             f"{type(self.model).__name__} {self.model!r}")
        if not isinstance(self.dtype, (str, torch.dtype)):
            raise ValueError(f"dtype must be a str such as 'float32', got {self.dtype!r}")
        self._validate_device()
        # torch.Generator.manual_seed accepts exactly this range.
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must be an int in [-2**63, 2**64), got {self.seed!r}")
        for name in ("block_size", "max_num_batched_tokens"):
            if not _is_positive_int(getattr(self, name)):
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_num_seqs is not None and not _is_positive_int(self.max_num_seqs):
            raise ValueError(f"max_num_seqs must be a positive int or None (derived), got {self.max_num_seqs!r}")
        # A derived max_num_seqs fits max_num_batched_tokens by construction (and is validated again).
        if self.max_num_seqs is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running request can decode each step")
        if self.cache_memory_bytes is not None and (not isinstance(self.cache_memory_bytes, int)
                                                    or self.cache_memory_bytes <= 0):
            raise ValueError(f"cache_memory_bytes must be a positive int, got {self.cache_memory_bytes!r}")
        from hybrid_engine.quantization import parse_quantization
        parse_quantization(self.quantization, self.quantization_group_size)
        from hybrid_engine.kernels.backends import BACKENDS
        if self.kernel_backend not in BACKENDS:
            raise ValueError(f"kernel_backend must be one of {BACKENDS}, got {self.kernel_backend!r}")
        for name in ("enforce_eager", "enable_torch_compile", "bf16_few_rows_copy", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and (not isinstance(sizes, (list, tuple)) or not sizes or not all(
                _is_positive_int(b) and b <= (self.max_num_seqs or b) for b in sizes)):
            raise ValueError(f"cuda_graph_batch_sizes must be a non-empty list of ints in 1..max_num_seqs "
                             f"({self.max_num_seqs}), got {sizes!r}")
        n = self.prefix_checkpoints
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"prefix_checkpoints must be a positive int or None, got {n!r}")
        every = self.prefix_checkpoint_interval
        if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1
                                  or every % self.block_size):
            raise ValueError(f"prefix_checkpoint_interval must be a positive multiple of block_size "
                             f"({self.block_size}) or None, got {every!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2, got {self.max_model_len!r}")
        self._validate_tensor_parallel()

    def _validate_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not _is_positive_int(size):
            raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
        if size == 1:
            return
        unsupported = [what for what, used in (
            ("device other than cpu", torch.device(self.device).type != "cpu"),
            ("enable_torch_compile", self.enable_torch_compile)) if used]
        if unsupported:
            raise ValueError(f"tensor_parallel_size > 1 does not support {', '.join(unsupported)} yet")

    def _validate_device(self) -> None:
        if not isinstance(self.device, (str, torch.device)):
            raise ValueError(f"device must be a str such as 'cpu' or 'cuda', got {self.device!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError:
            raise ValueError(f"device {self.device!r} is not a torch device; use 'cpu' or 'cuda'") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {self.device!r} is not supported; use 'cpu' or 'cuda'")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r} asked for, but torch sees no CUDA device")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {self.device!r} asked for, but torch sees "
                                 f"{torch.cuda.device_count()} CUDA device(s)")


def _is_positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
