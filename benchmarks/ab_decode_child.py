"""One side of an interleaved A/B, the child of benchmarks/pair_llamacpp.py, roofline_pairs.py and
probes/ab_decode.py: loads an engine from the tree it runs in (the working directory), then on
each 'go' line from stdin runs N decode steps at batch 1 and prints the seconds they took."""
import sys, time, os
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
torch.set_num_threads(int(os.environ.get("AB_THREADS", "2")))
from bench_cpu import make_engine
from hybrid_engine import SamplingParams
folder, dtype, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
compile = len(sys.argv) > 4 and sys.argv[4] == "compiled"
e = make_engine(folder, dtype, 1, compile=compile)
# as long as the engine's context allows (bench_cpu's engines: 640 tokens); a block that finds
# the request finished starts another (one 32-token prefill in such a block, on both sides)
params = SamplingParams(temperature=0.0, max_tokens=e.config.max_model_len - 33, ignore_eos=True)
def step():
    if not e.has_unfinished_requests():
        e.add_request(list(range(1, 33)), params)
    e.step()
step()
for _ in range(3 if not compile else 40): step()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "go": break
    t = time.perf_counter()
    for _ in range(steps): step()
    print(time.perf_counter() - t, flush=True)
