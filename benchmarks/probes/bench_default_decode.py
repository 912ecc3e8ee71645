"""The default (embedded) model's batch-1 greedy decode at 2 threads, eager and compiled engines
in one process, alternated 5 times (256 steps each after a warm-up that compiles), medians:
issue 16's default-model figure.

    python benchmarks/probes/bench_default_decode.py OUT.json
"""
import datetime
import json
import os
import statistics
import sys
from pathlib import Path

if sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
if len(sys.argv) != 2:
    sys.exit(__doc__)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu, random_checkpoint, ...
from bench_cpu import engine_decode, make_engine  # noqa: E402
from hybrid_engine.default_model import default_model_path  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402

torch.set_num_threads(2)
load0 = os.getloadavg()[0]
eng = {"eager": make_engine(str(default_model_path()), "float32", 16),
       "compiled": make_engine(str(default_model_path()), "float32", 16, compile=True)}
vocab = eng["eager"].model_config.vocab_size
for e in eng.values():
    engine_decode(e, 1, 64, vocab)                    # warm-up (compiles)
runs = {k: [] for k in eng}
for _ in range(5):
    for k, e in eng.items():
        runs[k].append(engine_decode(e, 1, 256, vocab))
out = {k: {"tok_s": statistics.median(r["tok_s"] for r in v), "step_ms": statistics.median(r["step_ms"] for r in v),
           "forward_ms": statistics.median(r["forward_ms"] for r in v), "runs": v} for k, v in runs.items()}
for k, v in out.items():
    print(f"{k}: b1 {v['tok_s']:.1f} tok/s, step {v['step_ms']:.3f} ms, forward {v['forward_ms']:.3f} ms  runs {[round(r['tok_s']) for r in v['runs']]}")
replays = eng["compiled"].runner.execution._decode_replay.replays
steps = 64 + 5 * 256
print(f"compiled: {replays} of {steps} decode steps replayed their graph (hybrid_engine/graph_replay.py)")
print(f"level {cpu_level()}, load {load0:.2f} -> {os.getloadavg()[0]:.2f}")
json.dump({"date": datetime.date.today().isoformat(), "level": cpu_level(), "threads": 2, "results": out, "replayed_steps": replays}, open(sys.argv[1], "w"), indent=1)
