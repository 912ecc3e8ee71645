"""Registering a native kernel as an operator torch.compile graphs can call (namespace
`hybrid_engine_cpu`): inductor leaves it as one extern call and traces its fake instead.

torch.library.custom_op would do the same with about 20 us of Python per call (its mutation
and autograd checks), more than the GDN kernel itself at decode sizes; a plain library
definition costs about 1.5 us.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIB = torch.library.Library("hybrid_engine_cpu", "FRAGMENT")


def define_graph_op(schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """schema: "name(Tensor x, Tensor(a!) mutated, ...) -> Tensor"; impl runs on CPU tensors,
    fake returns outputs of the right shape and dtype from fake inputs. -> the op."""
    name = schema.split("(", 1)[0]
    try:    # defined already: this module imported a second time under another name (with the
        # repository root on sys.path, transformers' probe for its `kernels` package imports ours)
        return getattr(torch.ops.hybrid_engine_cpu, name).default
    except AttributeError:
        pass
    _LIB.define(schema)
    _LIB.impl(name, impl, "CPU")
    torch.library.register_fake(f"hybrid_engine_cpu::{name}", fake, lib=_LIB)
    return getattr(torch.ops.hybrid_engine_cpu, name).default
