"""Tensor parallelism as the model sees it: which part of each weight this rank holds, and the
two collectives that join the parts (handed in by the engine; models never see a process).

A rank of N holds, per layer, 1/N of the heads: attention's q (with its gate), k and v by
heads (KV heads replicated when there are fewer than N: rank r then holds KV head r * nkv // N),
GDN's q, k, v, z, b, a, conv taps, A_log and dt_bias by key / value heads, the MLP's gate and
up rows; o_proj, GDN's out_proj and the MLP's down_proj take the matching input columns, and
their partial outputs are summed across ranks (`all_reduce`). lm_head holds 1/N of the
vocabulary rows (the last rank's part padded with zero rows where N does not divide the
vocabulary) and the logits are gathered on rank 0 (`gather_logits`). An MoE block splits its
experts whole over the ranks (expert parallelism: rank r holds experts [r E/N, (r+1) E/N)),
keeps its router and shared-expert gate whole (every rank routes every token and runs its own
experts on the tokens routed to them), splits the shared expert's intermediate rows like the
MLP's, and sums its output once. The embedding holds lm_head's vocabulary rows (tied or not):
each rank looks up the ids it holds and the rows are summed across ranks, one all-reduce per
forward beside the two of each layer, where a whole table would cost every rank V x H bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import ModelConfig


@dataclass(frozen=True)
class Split:
    """One rank's part of a checkpoint tensor: along `dim`, each of `segments` (consecutive runs
    of the full tensor, by their sizes) cut into `parts` equal pieces (a segment that `parts`
    does not divide is padded with zeros first), of which the rank keeps piece `index`; its
    pieces of the segments, in order, are its tensor."""

    dim: int
    segments: tuple[int, ...]
    parts: int
    index: int

    def local_size(self) -> int:
        return sum(-(-s // self.parts) for s in self.segments)

    def full_shape(self, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(self.segments)
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        pieces, start = [], 0
        for size in self.segments:
            piece = -(-size // self.parts)
            lo, hi = start + min(self.index * piece, size), start + min((self.index + 1) * piece, size)
            part = full.narrow(self.dim, lo, hi - lo)
            if hi - lo < piece:
                pad = list(full.shape)
                pad[self.dim] = piece - (hi - lo)
                part = torch.cat([part, full.new_zeros(pad)], dim=self.dim)
            pieces.append(part)
            start += size
        if len(pieces) > 1:
            return torch.cat(pieces, dim=self.dim)
        part = pieces[0].contiguous()
        # a piece cut along the first dim is still a view, which would keep the whole tensor
        # alive (stacked experts split by expert: every rank holding all of them)
        return part.clone() if part.untyped_storage().nbytes() > part.numel() * part.element_size() else part

    def per_entry(self, columns: int) -> Split:
        """The same cut of a tensor with one entry per `columns` of this one's along `dim` (a
        quantized checkpoint's group scales beside its values): whole groups, as
        `check_tensor_parallel` makes sure."""
        return Split(self.dim, tuple(s // columns for s in self.segments), self.parts, self.index)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in the group, and the group's collectives (None for a single process):
    all_reduce sums a tensor across ranks in place and returns it; gather_logits joins the
    ranks' vocabulary parts [rows, V/N] along the last dimension on rank 0 (elsewhere it
    returns its input, which nobody reads)."""

    rank: int = 0
    size: int = 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    gather_logits: Callable[[torch.Tensor], torch.Tensor] | None = None

    def heads(self, count: int) -> int:
        """This rank's share of `count` heads (1 where the heads are replicated)."""
        return max(count // self.size, 1)

    def by_heads(self, heads: int, rows_per_head: int, dim: int = 0) -> Split:
        """Heads split contiguously over the ranks, or replicated in groups where fewer than ranks."""
        parts = min(heads, self.size)
        return Split(dim, (heads * rows_per_head,), parts, self.rank * parts // self.size)

    def by_segments(self, segments: tuple[int, ...], dim: int = 0) -> Split:
        return Split(dim, tuple(segments), self.size, self.rank)


SINGLE = TensorParallel()


def shard_parameter(param: torch.nn.Parameter, split: Split) -> None:
    """Marks a parameter (declared at the rank's size) as `split` of its checkpoint tensor:
    models/load.py then expects the full tensor and keeps the rank's part."""
    param.tp_split = split


def check_tensor_parallel(cfg: ModelConfig, size: int, group_size: int | None = None,
                          row_block: int | None = None) -> None:
    """ValueError naming each dimension of `cfg` that tensor_parallel_size `size` cannot split
    and the sizes that work (checked by the engine before any process starts). group_size: a
    quantized model's (online quantization's, where each rank quantizes its own part; a GGUF
    file's blocks; a folder stored quantized, its groups or blocks): the input columns of a
    projection whose partial outputs the ranks sum (o_proj, out_proj, down_proj) must then split
    into whole groups, or a rank's groups would not be the whole model's (where the width holds
    no whole groups at all, the projection stays float at any size). row_block: the output rows
    a rank's part of a stored tensor must hold whole (packed zero points, FP8 scale blocks), for
    the projections split by their rows (q / k / v, GDN's in_proj, gate / up)."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if size == 1:
        return
    dims = _dimensions(cfg)
    grouped = ([] if group_size is None else
               [(name, count, _in_groups(group_size)) for name, count in _split_columns(cfg)])
    blocked = ([] if row_block is None else
               [(name, count, _in_row_blocks(row_block, heads)) for name, count, heads in _split_rows(cfg)])
    uneven = [f"{name} ({count})" for name, count, ok in dims if not ok(count, size)]
    cut = [f"{name} ({count})" for name, count, ok in grouped if not ok(count, size)]
    cut_rows = [f"{name} ({count})" for name, count, ok in blocked if not ok(count, size)]
    if uneven or cut or cut_rows:
        works = [n for n in range(1, 65) if all(ok(count, n) for _, count, ok in dims + grouped + blocked)]
        what = [f"{', '.join(uneven)} evenly"] if uneven else []
        what += [f"{', '.join(cut)} into whole quantization groups of {group_size} per rank"] if cut else []
        what += [f"{', '.join(cut_rows)} into whole blocks of {row_block} rows per rank"] if cut_rows else []
        raise ValueError(f"tensor_parallel_size {size} does not split {'; nor '.join(what)}; "
                         f"sizes that work for this model: {', '.join(map(str, works))}")


def _divides(count: int, size: int) -> bool:
    return count % size == 0


def _divides_or_replicates(count: int, size: int) -> bool:
    return count % size == 0 or size % count == 0


def _in_groups(group_size: int) -> Callable[[int, int], bool]:
    return lambda count, size: count % group_size != 0 or count % (size * group_size) == 0


def _in_row_blocks(block: int, heads: int) -> Callable[[int, int], bool]:
    """A rank's rows of a projection split by `heads` (replicated where fewer than ranks) are
    whole blocks."""
    return lambda count, size: count % min(heads, size) == 0 and count // min(heads, size) % block == 0


def _dimensions(cfg: ModelConfig) -> list[tuple[str, int, Callable[[int, int], bool]]]:
    dims = [("num_attention_heads", cfg.num_attention_heads, _divides),
            ("num_key_value_heads", cfg.num_key_value_heads, _divides_or_replicates),
            ("linear_num_key_heads", cfg.linear_num_key_heads, _divides),
            ("linear_num_value_heads", cfg.linear_num_value_heads, _divides)]
    if any(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)):
        dims.append(("num_experts", cfg.num_experts, _divides))
    return dims + [(name, count, _divides) for name, count in _mlp_widths(cfg)]


def _mlp_widths(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The intermediate widths split by rows (gate / up) and columns (down): the dense MLP's
    where a layer has one, the MoE shared expert's where a layer has one (the experts are whole
    on their rank)."""
    moe = [cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers)]
    widths = [("intermediate_size", cfg.intermediate_size)] if not all(moe) else []
    return widths + ([("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)] if any(moe) else [])


def _split_columns(cfg: ModelConfig) -> list[tuple[str, int]]:
    """The input widths of the projections split by their input columns."""
    return [("num_attention_heads x head_dim", cfg.num_attention_heads * cfg.head_dim),
            ("linear_num_value_heads x linear_value_head_dim", cfg.value_dim)] + _mlp_widths(cfg)


def _split_rows(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """The output heights of the projections split by their rows, each with the heads it splits
    by (its own height where it splits by rows)."""
    rows = [("num_attention_heads x head_dim", cfg.num_attention_heads * cfg.head_dim, cfg.num_attention_heads),
            ("num_key_value_heads x head_dim", cfg.num_key_value_heads * cfg.head_dim, cfg.num_key_value_heads),
            ("linear_num_key_heads x linear_key_head_dim", cfg.key_dim, cfg.key_dim),
            ("linear_num_value_heads x linear_value_head_dim", cfg.value_dim, cfg.value_dim)]
    return rows + [(name, count, count) for name, count in _mlp_widths(cfg)]
