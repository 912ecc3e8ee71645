import os

import torch

# Two cores: more torch threads than cores makes timings and test runs collapse.
torch.set_num_threads(min(2, os.cpu_count() or 1))
