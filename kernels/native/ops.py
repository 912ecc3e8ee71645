"""The native kernels as torch operators: `native_ops()` is `torch.ops.hybrid_engine_cpu` once
the library (kernels/native/ops.cpp with the kernels, built by build.py) is loaded, or None where
the kernels cannot run. Eager code and compiled graphs call the same ops: their CPU
implementations are C++ (checks, casts, output allocation and the kernel call), so no call
passes through Python; inductor leaves each as one extern call and traces the fakes below.

A kernel (its C++ in its op's folder, kernels/conv/causal_conv1d_update.cpp) becomes an op in
four steps here (the conv update as the example):
  kernels.h   CONV_UPDATE_ENTRY(conv_update_f32_f32, float, float);     the C entry point
  ops.cpp     Tensor causal_conv1d_update(const Tensor& x, ...) {...}   checks, allocates, calls
              m.def("causal_conv1d_update(Tensor x, ..., Tensor(a!) window_pool, ...) -> Tensor");
              m.impl("causal_conv1d_update", causal_conv1d_update);
  build.py    SOURCES += conv/causal_conv1d_update.cpp
  ops.py      FAKES["causal_conv1d_update"] = the output's shape and dtype from the inputs'
and the op's cpu form (kernels/conv/cpu.py) calls `torch.ops.hybrid_engine_cpu.causal_conv1d_update.default`
where its routing (can_run_native, decided once per call site from shapes and dtypes) allows.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import torch

from .build import library_name, load_ops

BLOCK = 16          # output columns per block of a blocked weight (kernels/linear/blocked.py)
FAKES = {
    "linear_blocked": lambda x, w_blocked, widen: x.new_empty(*x.shape[:-1], w_blocked.shape[0] * BLOCK),
    "linear_quant": lambda x, q, zeros, bits, group: x.new_empty(*x.shape[:-1], q.shape[0] * BLOCK),
    "linear_quant_tail": lambda x, q, zeros, bits, group, tail_blocked, widen, tail_rows:
        x.new_empty(*x.shape[:-1], q.shape[0] * BLOCK + tail_rows),
    "quantize_int4": lambda w, group: (w.new_empty(w.shape, dtype=torch.int8),
                                       w.new_empty(w.shape[0], w.shape[1] // group, dtype=torch.float16)),
    "quant_rows": lambda q, zeros, ids, bits, group, k: q.new_empty(ids.shape[0], k, dtype=torch.float32),
    "rescore_top": lambda x, y, q, zeros, bits, group, count: None,
    "blocked_rows": lambda w_blocked, ids, k: w_blocked.new_empty(ids.shape[0], k),
    "mlp_blocked": lambda x, gate_up_blocked, down_blocked: x.new_empty(*x.shape[:-1], down_blocked.shape[0] * BLOCK),
    "mlp_quant": lambda x, gate_up_q, gate_up_zeros, down_q, *_: x.new_empty(*x.shape[:-1], down_q.shape[0] * BLOCK),
    "gdn_recurrent": lambda kq, decay, beta, v, *_: v.new_empty(v.shape, dtype=torch.float32),
    "paged_attention_decode": lambda q, *_: q.new_empty(q.shape, dtype=torch.float32),
    "causal_conv1d_update": lambda x, *_: x.new_empty(x.shape),
    "gdn_decode": lambda mixed, b, a, conv_weight, conv_pool, dt_bias, neg_decay_rate, state_pool, *_:
        mixed.new_empty(*mixed.shape[:2], state_pool.shape[1], state_pool.shape[3]),
    "rms_norm": lambda x, *_: x.new_empty(x.shape),
    "add_rms_norm": lambda x, *_: (x.new_empty(x.shape), x.new_empty(x.shape)),
    "gated_rms_norm": lambda x, *_: x.new_empty(x.shape),
    "silu_mul": lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2),
    "apply_token_bitmask": lambda logits, bitmask: None,
    "qk_norm_rope": lambda q, k, *_: q.new_empty(q.shape[0], q.shape[1] + k.shape[1], q.shape[2]),
}
_FAKES_REGISTERED: set[str] = set()


def native_ops(level: str | None = None) -> torch._ops._OpNamespace | None:
    """The ops built for `level` (None: this process's; a lower level's ops sit in a namespace
    of their own, for tests), loaded on first use; None where they cannot run."""
    ops = load_ops(level)
    if ops is not None and ops.name not in _FAKES_REGISTERED:
        for name, fake in FAKES.items():
            torch.library.register_fake(f"{ops.name}::{name}", fake)
        _FAKES_REGISTERED.add(ops.name)
    return ops


@functools.lru_cache(maxsize=1)          # a constant of the process: every engine asks
def graph_cache_tag() -> str:
    """What compiled graphs that call these ops must key their on-disk caches by (compiled_steps
    sets it as torch.compiler.config.cache_key_tag while inductor compiles): the library's name,
    which changes with the C++ (the kernels, the wrappers, the schemas), and a digest of this
    file (the fakes). Inductor keys a cached graph by its code and config, not by the ops it
    calls: a graph compiled against an earlier gdn_decode (other arguments, another fake) was
    served from the cache and called the new op, which corrupted the heap (2026-12-01/02)."""
    fakes = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]
    return f"{library_name() or 'no-native-ops'}:{fakes}"
