"""One side of an interleaved A/B, the child of benchmarks/pair_llamacpp.py, roofline_pairs.py and
probes/ab_decode.py: loads an engine from the tree it runs in (the working directory), then on
each 'go' line from stdin runs N steps and prints the seconds they took.

What a step is, from the environment (both sides get the same):
- default: batch-1 greedy decode;
- AB_BATCH=B: decode with B requests running at once (a step emits B tokens);
- AB_PREFILL=L: one step prefills a fresh L-token prompt (prefix caching off, so no step reuses
  another's blocks) and emits one token;
- AB_SPEC_K=k: batch-1 greedy decode with MTP k (a step verifies k drafts and drafts again; the
  tokens, and so the acceptance, are the same on both sides);
and AB_QUANTIZATION=int8|int4 quantizes the projections at load (groups of 32), with any of them."""
import sys, time, os
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
import torch
torch.set_num_threads(int(os.environ.get("AB_THREADS", "2")))
from bench_cpu import make_engine
from hybrid_engine import SamplingParams
folder, dtype, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
compile = len(sys.argv) > 4 and sys.argv[4] == "compiled"
batch = int(os.environ.get("AB_BATCH", "1"))
prefill = int(os.environ.get("AB_PREFILL", "0"))
spec_k = int(os.environ.get("AB_SPEC_K", "0"))
quantization = os.environ.get("AB_QUANTIZATION") or None
if spec_k:
    from hybrid_engine.config import EngineConfig
    from hybrid_engine.engine import LLMEngine
    e = LLMEngine(EngineConfig(model=folder, dtype=dtype, max_num_seqs=1, max_model_len=640,
                               enable_torch_compile=compile, quantization=quantization,
                               speculative_config={"method": "mtp", "num_speculative_tokens": spec_k}))
else:
    e = make_engine(folder, dtype, batch, compile=compile, prefix_caching=not prefill, quantization=quantization)
vocab = e.model_config.vocab_size
if prefill:
    gen = torch.Generator().manual_seed(0)

    def step():
        e.add_request(torch.randint(1, vocab, (prefill,), generator=gen).tolist(),
                      SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        while e.has_unfinished_requests():
            e.step()
else:
    # as long as the engine's context allows (bench_cpu's engines: 640 tokens); a block that finds
    # the requests finished starts others (one 32-token prefill in such a block, on both sides)
    params = SamplingParams(temperature=0.0, max_tokens=e.config.max_model_len - 33 - 2 * spec_k, ignore_eos=True)

    def step():
        if not e.has_unfinished_requests():
            for i in range(batch):
                e.add_request([(i + t) % (vocab - 1) + 1 for t in range(32)], params)
        e.step()
step()
for _ in range(2 if prefill else 3 if not compile else 40): step()
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() != "go": break
    t = time.perf_counter()
    for _ in range(steps): step()
    print(time.perf_counter() - t, flush=True)
