"""Native CPU kernels (C++ built at first use, torch references beside them)."""

from .blocked import (block_weight, blocked_linear, blocked_linear_reference, can_block,
                             native_available)

__all__ = ["block_weight", "blocked_linear", "blocked_linear_reference", "can_block", "native_available"]
