"""Tensor parallelism over a stored-quantized projection's tensors: a rank's Split of the
[out, in] weight (models/parallel.py) applied to each stored tensor along that tensor's own dim
for the weight's (GPTQ stores its values transposed), at one stored entry per fixed number of
the weight's rows or columns (32 / bits for packed values, the group or block for scales). A
format describes each tensor by `Along`s, one per weight dim (None: the tensor has no such dim
and every rank holds it whole). A cut that would split a group, a block or a packed word is an
error here; the engine refuses such sizes before any process starts (models/parallel.py
check_tensor_parallel), so this meets only what that check does not cover (a quantized lm_head
whose vocabulary the ranks split unevenly)."""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch


class Along(NamedTuple):
    dim: int                 # the stored tensor's dim
    per_entry: int           # the weight's rows or columns per entry along it


def cut(tensor: torch.Tensor, split, along: Along | None, name: str) -> torch.Tensor:
    """This rank's part of stored tensor `name`."""
    if along is None:
        return tensor
    # one entry per row or column: a part the ranks split unevenly is padded (Split.take)
    if along.per_entry > 1 and any(s % (split.parts * along.per_entry) for s in split.segments):
        raise ValueError(f"tensor {name} cannot be split into {split.parts} parts of whole groups, blocks or "
                         f"packed words of {along.per_entry} (its weight's sizes along the split: {split.segments})")
    return replace(split, dim=along.dim).per_entry(along.per_entry).take(tensor)


def full_shape(shape: tuple[int, ...], split, along: Along | None) -> tuple[int, ...]:
    """The stored shape of a tensor of which this rank holds `shape` (`cut`)."""
    if along is None:
        return tuple(shape)
    return replace(split, dim=along.dim).per_entry(along.per_entry).full_shape(shape)


class StoredParts:
    """A format's `rank_part` and `full_shape` (kernels/linear/quantized.py QuantizedCheckpoint)
    from its `_along(suffix)`: the Along of each of the weight's dims for a stored tensor."""

    def _along(self, suffix: str) -> tuple[Along | None, Along | None]:
        raise NotImplementedError

    def rank_part(self, name: str, tensor: torch.Tensor, split) -> torch.Tensor:
        return cut(tensor, split, self._along(name.rpartition(".")[2])[split.dim], name)

    def full_shape(self, name: str, shape: tuple[int, ...], split) -> tuple[int, ...]:
        return full_shape(shape, split, self._along(name.rpartition(".")[2])[split.dim])
