"""Persistent step buffers and the host writes that fill them (seed 002).

Every tensor a forward reads lives in a buffer allocated once, sized for the largest step; a
step writes its host values into the front of each buffer and hands the model views of the
used prefix, so a step's inputs sit at fixed addresses (what a captured CUDA graph and a
replayed compiled graph need). The step builder (step_inputs.py) and the drafting builder
(draft_inputs.py) each own a set.
"""

from __future__ import annotations

import numpy as np
import torch


class PackedBuffers:
    """A subclass allocates its buffers as attributes, then calls `_host_views` with their names."""

    block_tables: torch.Tensor          # [max_num_seqs, max_blocks_per_seq]: bounds `_table_width`

    def _host_views(self, names: tuple[str, ...], device: torch.device | str) -> None:
        # Numpy views of the buffers where they are host memory (CPU), None elsewhere: a step's
        # host values are written through them: an assignment costs a fraction of a tensor made
        # of the list and its copy, ten times a step (benchmarks/history/RESULTS_LOG.md).
        self._device = torch.device(device)
        self._host = {name: getattr(self, name).numpy() for name in names} if self._device.type == "cpu" else None

    def _put(self, *fields: tuple) -> list[torch.Tensor]:
        """Writes each field (name, values) or (name, values, columns) into the front of buffer
        `name`: its first len(values) entries, or for a 2-D buffer the first `columns` of its
        first len(values) // columns rows, row by row. On CPU through the numpy views; elsewhere
        all fields in one host-to-device conversion (each costs more than a copy). -> the views
        written, in order."""
        views, flat = [], []
        for name, values, *columns in fields:
            buffer = getattr(self, name)
            view = buffer[:len(values) // columns[0], :columns[0]] if columns else buffer[:len(values)]
            views.append(view)
            if self._host is None:
                flat.extend(values)
            elif columns:
                self._host[name][:view.shape[0], :columns[0]] = np.array(values, dtype=self._host[name].dtype
                                                                         ).reshape(view.shape)
            else:
                self._host[name][:len(values)] = values
        if self._host is None:
            parts = torch.tensor(flat, dtype=torch.int64).to(self._device).split([v.numel() for v in views])
            for view, part in zip(views, parts):
                view.copy_(part.view(view.shape))        # casts where the buffer is not int64
        return views

    def _table_width(self, blocks: int, keyless: bool) -> int:
        """The block-table columns of a step whose longest table has `blocks` blocks. Where the
        attention reads no keys, the next power of two (at most the buffer's width): the native
        kernel reads a sequence's own blocks only, so the padding costs nothing, and a steady
        decode then widens its table, and so changes its batch object (a compiled step's replay
        misses: graph_replay.py), at a handful of block boundaries instead of at every one.
        Otherwise exactly `blocks`: paged keys are as wide as the table."""
        if not keyless:
            return blocks
        return min(1 << (max(blocks, 1) - 1).bit_length(), self.block_tables.shape[1])
