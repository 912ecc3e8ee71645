"""What torch.compile needs to know of the kernels' routing: each op's `native_available` (is
the library loaded at this level) is a constant of the process, so dynamo takes its value instead
of tracing into the loader (which reads files: a graph break, an error under fullgraph).

`mark_native_checks()` is called by whatever compiles (hybrid_engine/compiled_steps.py; the
tests that compile an op), not by the kernels themselves: the decorator imports dynamo, about 70 MiB resident that an eager
engine never uses (benchmarks/RESULTS.md, issue 39)."""

import torch

from ..attention import cpu as attention_cpu
from ..conv import cpu as conv_cpu
from ..gdn import decode_cpu as gdn_decode_cpu, recurrent_cpu as gdn_recurrent_cpu


def mark_native_checks() -> None:
    """Marks the checks (once is enough; again is harmless)."""
    for check in (attention_cpu.native_available, conv_cpu.native_available, gdn_decode_cpu.native_available,
                  gdn_recurrent_cpu.native_available):
        torch.compiler.assume_constant_result(check)
