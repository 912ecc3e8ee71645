"""Native CPU kernels (C++ built at first use for the level of the CPU probe isa.py, torch
references beside them)."""

from .blocked import (block_weight, blocked_linear, blocked_linear_reference, can_block,
                             native_available)
from .isa import cpu_level

__all__ = ["block_weight", "blocked_linear", "blocked_linear_reference", "can_block", "cpu_level",
           "native_available"]
