"""Small unsigned integers packed into int32 words, 32 / bits a word along one dimension, the first
in the lowest bits: how compressed-tensors (weight_packed) and GPTQ (qweight, qzeros) store
their codes. The formats add their own offsets."""

from __future__ import annotations

import torch


def pack_fields(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned fields (any int dtype) -> int32 words along `dim`, the last word zero-padded."""
    per_int = 32 // bits
    moved = values.to(torch.int64).movedim(dim, -1)
    moved = torch.nn.functional.pad(moved, (0, -moved.shape[-1] % per_int))
    grouped = moved.reshape(*moved.shape[:-1], -1, per_int)
    words = sum(grouped[..., i] << (bits * i) for i in range(per_int))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32).movedim(-1, dim).contiguous()


def unpack_fields(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned fields (int64), 32 / bits per word along `dim` (padding kept)."""
    per_int, mask = 32 // bits, (1 << bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF
    fields = torch.stack([(words >> (bits * i)) & mask for i in range(per_int)], dim=dim + 1)
    shape = list(packed.shape)
    shape[dim] *= per_int
    return fields.reshape(shape)
