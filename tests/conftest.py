import os

import torch

# Tests run tiny models, where a step is all overhead: one thread is as fast, and it does not
# collapse when the 2-core machine is busy (more busy threads than cores does).
torch.set_num_threads(1)

# tests/triton runs in a process of its own (TRITON_INTERPRET=1, fla importable): .ci/run_triton
if os.environ.get("HYBRID_ENGINE_TRITON_TESTS") != "1":
    collect_ignore = ["triton"]
