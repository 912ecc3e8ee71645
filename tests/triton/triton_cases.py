"""Shared inputs for the triton-vs-torch tests (float32, tiny shapes)."""

from __future__ import annotations

import torch

from hybrid_engine.kernels.backends import TORCH_OPS
from kernel_cases import gdn_inputs, make_cu  # noqa: F401  (re-exported for the triton tests)

TORCH = dict(TORCH_OPS)       # the torch backend's ops: the references


