"""The three kernel backends. An engine chooses one at construction (`make_backend`) and hands
it down in every step's ForwardBatch; the layers call its ops (`batch.kernels.rms_norm(...)`).
No module-level state picks a backend.

    torch   the reference: the torch form of every op, runs everywhere, calls no native code
    cpu     the native C++ kernels (each op folder's cpu form, CPU_FORMS) for the level the ISA
            probe allows (kernels/native/isa.py), each op falling back to its torch form where
            its kernel cannot take the call (the cpu form says where)
    triton  the GPU kernels (each op folder's triton form, TRITON_FORMS; imported on first use:
            fla takes seconds)

The norms and the SwiGLU activation are native in eager calls only: a step torch.compile traces
keeps their torch forms, which inductor fuses into its own loops. The conv update, the GDN
recurrence, the GDN decode step and decode attention are native in compiled graphs too (one
extern call each). Which form runs is decided by the cpu form, once per call from facts the
caller already holds (dtypes, shapes, the step's DecodeRows and AttentionLayout computed once by
the engine's builder), and by the same predicates the engine asks at build time (`CpuBackend`),
so no caller predicts what a kernel will do.

A backend also chooses the projections' linear method (`linear_method`, kernels/linear/: the
weights' layout after loading and the product), and answers the questions the engine's builder
asks once, at build time,
about how a step should be laid out for it: whether attention of a given query length reads
the step's PagedKeys (`attention_reads_keys`) and whether prefill segments' GDN layers run
through the decode kernel (`gdn_decode_serves_prefill`).
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from . import activation, attention, conv, gdn, norm, rope
from .linear import LinearMethod

BACKENDS = ("auto", "torch", "cpu", "triton")

OP_NAMES = ("add_rms_norm", "apply_partial_rope", "causal_conv1d_update", "causal_conv1d_varlen",
            "chunk_gated_delta_rule", "conv_windows_at", "gated_rms_norm", "gdn_decode", "paged_attention",
            "qk_norm_rope", "recurrent_gated_delta_rule", "rms_norm", "silu_mul", "write_kv_cache")

TORCH_OPS = {
    "add_rms_norm": norm.add_rms_norm_torch,
    "apply_partial_rope": rope.apply_partial_rope,
    "causal_conv1d_update": conv.causal_conv1d_update_torch,
    "causal_conv1d_varlen": conv.causal_conv1d_varlen,
    "chunk_gated_delta_rule": gdn.chunk_gated_delta_rule,
    "conv_windows_at": conv.conv_windows_at,
    "gated_rms_norm": norm.gated_rms_norm_torch,
    "gdn_decode": gdn.gdn_decode_torch,
    "paged_attention": attention.paged_attention,
    "qk_norm_rope": norm.qk_norm_rope_torch,
    "recurrent_gated_delta_rule": gdn.recurrent_gated_delta_rule,
    "rms_norm": norm.rms_norm_torch,
    "silu_mul": activation.silu_mul_torch,
    "write_kv_cache": attention.write_kv_cache,
}

# Where each backend's forms live: one module per op folder, which holds the ops of OP_NAMES that
# backend runs in a form of its own (the rest run their torch form).
CPU_FORMS = ("activation.cpu", "attention.cpu", "conv.cpu", "gdn.decode_cpu", "gdn.recurrent_cpu", "norm.cpu")
TRITON_FORMS = ("attention.triton", "conv.triton", "gdn.decode_triton", "gdn.triton", "norm.triton")


def forms(modules: tuple[str, ...]) -> dict:
    """The ops of OP_NAMES that `modules` (CPU_FORMS or TRITON_FORMS) define, by name."""
    ops = {}
    for path in modules:
        module = importlib.import_module(f"{__package__}.{path}")
        ops.update({name: getattr(module, name) for name in OP_NAMES if hasattr(module, name)})
    return ops


class KernelBackend:
    """One backend's ops as attributes (`backend.rms_norm(...)`), bound once."""

    def __init__(self, name: str, ops: dict):
        missing = set(OP_NAMES) - set(ops)
        if missing:
            raise ValueError(f"kernel backend {name!r} lacks ops {sorted(missing)}")
        self.name = name
        for op_name in OP_NAMES:
            setattr(self, op_name, ops[op_name])

    def linear_method(self, compiled: bool = False, few_rows_copy: bool = True) -> LinearMethod:
        """The projections' linear method for an engine on this backend: the plain weights here.
        compiled: the engine's steps are torch.compile'd; few_rows_copy: see CpuBackend."""
        return LinearMethod()

    def attention_reads_keys(self, kv_cache: torch.Tensor, num_heads: int, query_len: int) -> bool:
        """Whether attention of steps whose sequences all have `query_len` new tokens reads
        AttentionLayout.keys (the builder leaves them out where it does not)."""
        return True

    def gdn_decode_serves_prefill(self, conv_pool: torch.Tensor, state_pool: torch.Tensor, conv_kernel: int,
                                  dtype: torch.dtype) -> bool:
        """Whether prefill segments' GDN layers should run through gdn_decode token by token
        (ForwardBatch.recurrent_prefill) instead of the chunked form. The torch form of gdn_decode
        would loop over the tokens, and triton has chunked kernels of its own: no."""
        return False

    def __repr__(self) -> str:
        return f"KernelBackend({self.name!r})"


class CpuBackend(KernelBackend):
    def __init__(self):
        super().__init__("cpu", {**TORCH_OPS, **forms(CPU_FORMS)})

    def linear_method(self, compiled=False, few_rows_copy=True):
        """Each weight in the layout kernels/linear/cpu.py chooses for it: blocked for the
        native kernels, bf16/fp16 packed for oneDNN where the level allows (not under compiled
        steps: inductor's freezing packs the weights of its graphs itself), and bf16 with a
        blocked copy for products of a few rows unless few_rows_copy is False."""
        from .linear.cpu import CpuLinearMethod
        return CpuLinearMethod(onednn=not compiled, few_rows_copy=few_rows_copy)

    def attention_reads_keys(self, kv_cache, num_heads, query_len):
        from .attention.cpu import reads_cache_in_place
        return not reads_cache_in_place(kv_cache, num_heads, query_len)

    def gdn_decode_serves_prefill(self, conv_pool, state_pool, conv_kernel, dtype):
        from .gdn.decode_cpu import decode_kernel_serves_prefill
        return decode_kernel_serves_prefill(conv_pool, state_pool, conv_kernel, dtype)


def torch_backend() -> KernelBackend:
    return KernelBackend("torch", TORCH_OPS)


def cpu_backend() -> KernelBackend:
    return CpuBackend()


def triton_backend() -> KernelBackend:
    return KernelBackend("triton", {**TORCH_OPS, **forms(TRITON_FORMS)})


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def native_cpu_available() -> bool:
    from .native.ops import native_ops
    return native_ops() is not None


def make_backend(name: str, device: str | torch.device) -> KernelBackend:
    """The backend `name` for an engine on `device`. auto: triton on CUDA when triton imports,
    cpu on a CPU whose native kernels build for its level, torch otherwise."""
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        name = ("triton" if triton_available() else "torch") if on_cuda else (
            "cpu" if native_cpu_available() else "torch")
    if name == "cpu" and on_cuda:
        raise ValueError("kernel backend 'cpu' runs on CPU tensors only; the engine's device is CUDA")
    return {"torch": torch_backend, "cpu": cpu_backend, "triton": triton_backend}[name]()
