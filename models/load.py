"""Build a HybridForCausalLM from a local HF folder (config.json + safetensors), or from another
checkpoint source that gives the config and the weights under the same names (a GGUF file:
hybrid_engine/checkpoint_formats/gguf.py)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from torch import nn

from hybrid_engine.kernels.linear import LinearMethod

from .config import ConfigError, ModelConfig, load_config
from .linear import Linear
from .mlp import Experts
from .parallel import SINGLE, TensorParallel
from .loader import WeightStream, load_weights, resolve_dtype
from .qwen3_5 import HybridForCausalLM


class CheckpointSource(Protocol):
    """A checkpoint other than an HF folder: its config, and its tensors by our names."""
    config: ModelConfig

    def load_weights(self, config: ModelConfig, expected: dict[str, tuple[int, ...]],
                     dtype: torch.dtype) -> WeightStream:
        """`expected`'s tensors (the MTP head's left out if the checkpoint has none), read as
        the stream is iterated."""


def checkpoint_shapes(model: HybridForCausalLM) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint holds for `model`, by their names there (without the leading
    `model.`) -> shapes: each projection layer's own (`Linear.checkpoint_shapes`: a merged layer
    names each of its projections), every other parameter under its module's name. A tied
    lm_head has none of its own."""
    return {name: shape for name, (shape, _, _) in _checkpoint_tensors(model).items()}


def _checkpoint_tensors(model: HybridForCausalLM) -> dict[str, tuple[tuple[int, ...], Callable, nn.Module]]:
    """Checkpoint name -> (shape, what takes that tensor: the projection layer's weight loader,
    or the assignment of a module's parameter; the module that holds it)."""
    tensors = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if name == "lm_head" and model.cfg.tie_word_embeddings:
                continue                  # loaded with the embedding table (load_model)
            for ckpt_name, shape in module.checkpoint_shapes(name).items():
                tensors[ckpt_name] = (shape, lambda t, n=ckpt_name, m=module: m.weight_loader(n, t), module)
        else:
            for pname, p in module.named_parameters(recurse=False):
                split = getattr(p, "tp_split", None)        # a tensor-parallel rank's part (models/parallel.py)
                shape = tuple(p.shape) if split is None else split.full_shape(tuple(p.shape))
                tensors[f"{name}.{pname}" if name else pname] = (
                    shape, lambda t, m=module, a=pname, s=split: setattr(
                        m, a, nn.Parameter(t if s is None else s.take(t), requires_grad=False)),
                    module)
    return tensors


def load_model(folder: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               with_mtp: bool = False, method: LinearMethod | None = None,
               methods: Callable[[str, Linear], LinearMethod] | None = None,
               progress: Callable | None = None,
               source: CheckpointSource | None = None,
               tp: TensorParallel = SINGLE) -> tuple[HybridForCausalLM, ModelConfig]:
    """with_mtp: keep the checkpoint's MTP head (for speculative decoding). Its `mtp.*` tensors
    are read and checked either way (unless config.json's mtp_num_hidden_layers is 0: no head);
    without it they are dropped after the check, so no MTP weights stay resident and the model
    has no MTP layer (nor, then, its KV pool). method: the projections' linear method (the
    engine's kernel backend's; None: plain weights); methods: name, layer -> the method of each
    projection layer instead, where the choice is per layer (hybrid_engine/quantization.py), and
    of each MoE layer's experts (None: the stacked float weights; models/mlp.py Experts).
    The loader reads the checkpoint one tensor at a time and hands each to what takes it; a
    layer processes its weights (`process_weights_after_loading`: quantizes, repacks) as soon as
    its last tensor has arrived, so the float model never exists whole: loading holds the
    processed layers, the one being filled and one tensor read (progress: wraps the stream of
    tensors, a progress bar). source: where the config and weights come from instead of
    `folder`'s config.json and safetensors. tp: this rank's part of a tensor-parallel model
    (models/parallel.py): each sharded tensor is read whole and sliced as it arrives."""
    cfg = source.config if source is not None else load_config(folder)
    if with_mtp and cfg.mtp_num_hidden_layers == 0:
        where = folder if source is not None else Path(folder) / "config.json"
        raise ConfigError(f"{where} sets mtp_num_hidden_layers 0: the model has no MTP "
                          "head, so it cannot draft for speculative decoding")
    torch_dtype = resolve_dtype(dtype, cfg)
    # Built on the meta device: the loader's tensors are assigned, nothing is initialised twice.
    # mtp_num_hidden_layers 0 says there is no head: any mtp.* tensors are then left unread.
    with torch.device("meta"):
        model = HybridForCausalLM(cfg, with_mtp=cfg.mtp_num_hidden_layers != 0, method=method, tp=tp)
        if methods is not None:
            # experts first: those stored quantized add their per-expert projection layers, which
            # are then chosen for like any other (a checkpoint may quantize some projections only)
            for name, module in list(model.named_modules()):
                if isinstance(module, Experts) and (expert_method := methods(name, module)) is not None:
                    module.use_method(expert_method, torch_dtype)
            for name, module in model.named_modules():
                if isinstance(module, Linear):
                    module.use_method(methods(name, module), torch_dtype)
    tensors = _checkpoint_tensors(model)
    expected = {name: shape for name, (shape, _, _) in tensors.items()}
    stream = (source.load_weights(cfg, expected, torch_dtype) if source is not None
              else load_weights(folder, cfg, expected, torch_dtype, other_ranks=_other_ranks_experts(model)))
    keep_mtp = with_mtp and any(name.startswith("mtp.") for name in stream.names)
    if not keep_mtp:
        model.mtp = None
    kept = [name for name in stream.names if keep_mtp or not name.startswith("mtp.")]
    waiting = Counter(tensors[name][2] for name in kept)      # module -> its tensors still to come
    # (listed before loading: layers that processing adds, such as experts' own, are processed
    # by what adds them)
    unprocessed = [m for m in model.modules() if m is not model and hasattr(m, "process_weights_after_loading")]
    processed, untrimmed = set(), 0
    for name, tensor in (progress(stream) if progress is not None else stream):
        if name.startswith("mtp.") and not keep_mtp:
            continue                                          # read and checked, not kept
        _, take, module = tensors[name]
        untrimmed += tensor.numel() * tensor.element_size()
        tensor = tensor.to(device)
        take(tensor)
        if name == "embed_tokens.weight" and cfg.tie_word_embeddings:
            model.tie_lm_head(tensor)             # the table in lm_head's layout, now (the peak)
            processed.add(model.lm_head)
        del tensor
        waiting[module] -= 1
        if waiting[module] == 0 and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
            processed.add(module)
        if untrimmed >= TRIM_EVERY_BYTES:
            release_freed_memory()
            untrimmed = 0
    model.process_weights_after_loading([m for m in unprocessed if m not in processed])
    release_freed_memory()
    model.requires_grad_(False)
    return model.eval(), cfg


# Loading trims the heap (release_freed_memory) after the layer that brings the tensors taken
# since the last trim to this many bytes: trimmed only at the end, loading's peak held about
# 400 MiB more of freed pages (0.8B dims, int8); after every layer the trims, 6 ms each on a
# heap that size, took a tenth of the load time.
TRIM_EVERY_BYTES = 128 << 20


def _other_ranks_experts(model: nn.Module) -> tuple[str, ...]:
    """The name prefixes of the experts that other tensor-parallel ranks hold, where a MoE layer
    loads its experts stored per expert (a quantized checkpoint's: models/mlp.py Experts)."""
    return tuple(f"{name}.{e}." for name, m in model.named_modules() if isinstance(m, Experts) and m.per_expert
                 for e in range(m.num_experts) if not m.first <= e < m.first + m.num_local)


def release_freed_memory() -> None:
    """Hands the heap that loading freed back to the OS (glibc's malloc_trim; nothing elsewhere).
    Loading casts, merges and quantizes weights through transient copies, and glibc keeps the
    freed pages resident: a quantized 0.8B model held a third more memory after loading without
    this (benchmarks/RESULTS.md, issue 39)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")              # (runs ldconfig: once)
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None
