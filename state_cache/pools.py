"""CachePools: all cache memory, allocated once at start-up, and the copies within it.

A forward reads these (models/batch.py LayerCaches): the KV blocks of every full-attention
layer (the MTP layer's after the main model's), the GDN state slots of every GDN layer, and
the prefix checkpoint entries a prefill's forward writes (ForwardBatch.gdn_captures). Which
request holds which block, slot or entry is the manager's business (hybrid_cache.py), not
this object's: here is only memory.

Each GDN kind's pools are the layers of one tensor [layers, slots, ...] (each layer's a
contiguous view), and so are the checkpoint entries: a slot's state in every layer (a
checkpoint saved or loaded, a fork) is one copy, not one per layer and kind (a decode that
crosses a block boundary saves one).

Row `pad_slot` (the last) of every GDN pool belongs to no request: the padding rows of a
CUDA-graph decode step (hybrid_engine/cuda_graph_steps.py) read it and write nowhere, so a padded
row can never race a real row for a state. It counts in the byte budget.
"""

from __future__ import annotations

import torch

from .spec import CacheSpec


class CachePools:
    def __init__(self, spec: CacheSpec, num_blocks: int, num_slots: int, num_checkpoints: int,
                 device: str | torch.device = "cpu"):
        self.spec, self.num_blocks, self.num_slots, self.num_checkpoints = spec, num_blocks, num_slots, num_checkpoints
        # The copies made in this memory since the caller last took them, (method name, args)
        # each, where other processes hold the same geometry for other heads and repeat them
        # (tensor parallelism: hybrid_engine/tensor_parallel.py); None: nobody does.
        self.copies: list[tuple[str, tuple]] | None = None
        self.kv_caches = [
            torch.zeros((num_blocks, *spec.kv_block_shape), dtype=spec.kv_dtype, device=device)
            for _ in range(spec.num_attention_layers)
        ]
        self.pad_slot = num_slots
        self.conv_layers, self.recurrent_layers = _gdn_layers(spec, num_slots + 1, device)
        self.conv_states = list(self.conv_layers.unbind(0))
        self.recurrent_states = list(self.recurrent_layers.unbind(0))
        self.checkpoint_conv_layers, self.checkpoint_recurrent_layers = _gdn_layers(spec, num_checkpoints, device)
        self.checkpoint_conv_states = list(self.checkpoint_conv_layers.unbind(0))
        self.checkpoint_recurrent_states = list(self.checkpoint_recurrent_layers.unbind(0))
        # the target's hidden state at each checkpoint's last position (for the MTP layer's KV)
        self.checkpoint_hidden = torch.zeros((num_checkpoints, spec.hidden_size), dtype=spec.kv_dtype, device=device)

    def geometry(self) -> tuple[CacheSpec, int, int, int]:
        """What a CachePools of the same layout is made from (its spec, blocks, slots, checkpoints)."""
        return self.spec, self.num_blocks, self.num_slots, self.num_checkpoints

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """KV blocks src[i] -> dst[i] in every attention layer."""
        if self.copies is not None:
            self.copies.append(("copy_blocks", (src, dst)))
        device = self.kv_caches[0].device
        old, new = torch.tensor(src, device=device), torch.tensor(dst, device=device)
        for kv in self.kv_caches:
            kv.index_copy_(0, new, kv.index_select(0, old))

    def copy_slot(self, src: int, dst: int) -> None:
        """A GDN state (conv window and recurrent state of every layer) from slot src to dst."""
        if self.copies is not None:
            self.copies.append(("copy_slot", (src, dst)))
        for layers in (self.conv_layers, self.recurrent_layers):
            layers.select(1, dst).copy_(layers.select(1, src))

    def save_checkpoint(self, slot: int, entry: int, hidden: torch.Tensor | None) -> None:
        if self.copies is not None:
            self.copies.append(("save_checkpoint", (slot, entry, None)))   # the hidden state: rank 0's alone
        self.checkpoint_conv_layers.select(1, entry).copy_(self.conv_layers.select(1, slot))
        self.checkpoint_recurrent_layers.select(1, entry).copy_(self.recurrent_layers.select(1, slot))
        if hidden is not None:
            self.write_checkpoint_hidden(entry, hidden)

    def write_checkpoint_hidden(self, entry: int, hidden: torch.Tensor) -> None:
        """The target's hidden state at a checkpoint's last position, where checkpoints keep one
        (CacheSpec.hidden_size: with MTP)."""
        if self.checkpoint_hidden.shape[1]:
            self.checkpoint_hidden[entry].copy_(hidden)

    def load_checkpoint(self, entry: int, slot: int) -> None:
        if self.copies is not None:
            self.copies.append(("load_checkpoint", (entry, slot)))
        self.conv_layers.select(1, slot).copy_(self.checkpoint_conv_layers.select(1, entry))
        self.recurrent_layers.select(1, slot).copy_(self.checkpoint_recurrent_layers.select(1, entry))


def _gdn_layers(spec: CacheSpec, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    conv = torch.zeros((spec.num_gdn_layers, n, *spec.conv_slot_shape), dtype=spec.conv_dtype, device=device)
    recurrent = torch.zeros((spec.num_gdn_layers, n, *spec.recurrent_slot_shape), dtype=spec.state_dtype, device=device)
    return conv, recurrent
