"""The shapes and dtypes of all cache memory, as plain numbers the caller fills in.

The cache knows nothing about model configs: the engine builds a CacheSpec from its
ModelConfig, so imports point from the engine down to the cache, never back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

# Every size field must be at least 1, except these. A spec without GDN layers serves a
# plain transformer (slots then cost nothing); a conv kernel of 1 would keep no window.
_LEAST = {"num_gdn_layers": 0, "conv_kernel": 2, "hidden_size": 0}


@dataclass(frozen=True)
class CacheSpec:
    # full attention: every layer that keeps K/V, the MTP layer included when present
    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: torch.dtype
    # gated delta net: one conv window and one recurrent state per layer per slot
    num_gdn_layers: int
    conv_dim: int
    conv_kernel: int  # the window stores the last conv_kernel - 1 inputs
    num_v_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dtype: torch.dtype
    # float32 whatever the weight dtype: the state accumulates over the whole sequence
    state_dtype: torch.dtype = torch.float32
    # the target's hidden size: a prefix checkpoint keeps the final-normed hidden state at its
    # last position, for the MTP layer's KV there (state_cache/checkpoints.py); 0 keeps none
    hidden_size: int = 0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                continue
            least = _LEAST.get(f.name, 1)
            if not isinstance(value, int) or value < least:
                raise ValueError(f"CacheSpec.{f.name} must be an int >= {least}, got {value!r}")

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """Shape of one block in one layer's KV tensor (K and V stacked on dim 0)."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def conv_slot_shape(self) -> tuple[int, ...]:
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def recurrent_slot_shape(self) -> tuple[int, ...]:
        return (self.num_v_heads, self.key_head_dim, self.value_head_dim)

    @property
    def bytes_per_block(self) -> int:
        """One KV block across all attention layers, K and V."""
        return self.num_attention_layers * math.prod(self.kv_block_shape) * self.kv_dtype.itemsize

    @property
    def bytes_per_slot(self) -> int:
        """One state slot across all GDN layers, conv window and recurrent state."""
        conv = math.prod(self.conv_slot_shape) * self.conv_dtype.itemsize
        recurrent = math.prod(self.recurrent_slot_shape) * self.state_dtype.itemsize
        return self.num_gdn_layers * (conv + recurrent)

    def blocks_for(self, num_tokens: int) -> int:
        """KV blocks that hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

