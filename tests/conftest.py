import os

import torch

# Two cores: more torch threads than cores makes timings and test runs collapse.
torch.set_num_threads(min(2, os.cpu_count() or 1))

# tests/triton runs in a process of its own (TRITON_INTERPRET=1, fla importable): .ci/run_triton
if os.environ.get("HYBRID_ENGINE_TRITON_TESTS") != "1":
    collect_ignore = ["triton"]
