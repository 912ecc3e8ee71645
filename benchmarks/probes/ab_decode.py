"""Interleaved A/B of engine steps between two checkouts (e.g. a previous main in a git worktree
and this one): both engines loaded at once, each in its own process, tree and venv
(TREE/.venv/bin/python), timed blocks of STEPS steps alternated A B, B A, ... for PAIRS pairs,
the ratio B/A per pair. A step is a batch-1 decode; AB_BATCH=B, AB_PREFILL=L or AB_SPEC_K=k
among the ENV arguments make it a batched decode, a prefill or an MTP decode
(benchmarks/ab_decode_child.py). On a shared, drifting machine this settles a few percent where
separate runs minutes apart cannot (issue 16's no-regression A/B).

    python benchmarks/probes/ab_decode.py TREE_A TREE_B CHECKPOINT DTYPE STEPS PAIRS [compiled] [ENV=V ...] [OUT.json]
"""
import json, os, statistics, subprocess, sys
from pathlib import Path

if sys.argv[1:2] in (["-h"], ["--help"]):
    print(__doc__)
    sys.exit(0)
if len(sys.argv) < 7:
    sys.exit(__doc__)
a, b, folder, dtype, steps, pairs = sys.argv[1:7]
rest = [x for x in sys.argv[7:] if not x.endswith(".json")]
mode = "compiled" if "compiled" in rest else "eager"
# the children's environment, and this process's before it reads its level (recorded in the JSON)
os.environ.update(dict(x.split("=", 1) for x in rest if "=" in x))
env = dict(os.environ)

from hybrid_engine.kernels.native.isa import cpu_level, detected_level  # noqa: E402
def start(tree):
    return subprocess.Popen([f"{tree}/.venv/bin/python", str(Path(__file__).resolve().parents[1] / "ab_decode_child.py"), folder, dtype, steps, mode],
                            cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
procs = [start(a), start(b)]
for p in procs:
    while (line := p.stdout.readline()) and line.strip() != "ready":
        pass
def block(p):
    p.stdin.write("go\n"); p.stdin.flush()
    return float(p.stdout.readline())
ta, tb = [], []
for i in range(int(pairs)):
    order = procs if i % 2 == 0 else procs[::-1]
    r = {id(p): block(p) for p in order}
    ta.append(int(steps) / r[id(procs[0])]); tb.append(int(steps) / r[id(procs[1])])
for p in procs:
    p.stdin.write("stop\n"); p.stdin.close(); p.wait()
ratios = [y / x for x, y in zip(ta, tb)]
out = {"a": a, "b": b, "dtype": dtype, "mode": mode, "steps_per_block": int(steps), "env": rest,
       "a_tok_s": ta, "b_tok_s": tb, "median_a": statistics.median(ta), "median_b": statistics.median(tb),
       "ratio_b_over_a": ratios, "median_ratio": statistics.median(ratios), "load": os.getloadavg(),
       "cpu_level": cpu_level(), "cpu_detected_level": detected_level()}
print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in out.items() if not isinstance(v, list)}))
print("ratios", [round(r, 3) for r in sorted(ratios)])
if len(sys.argv) > 7 and sys.argv[-1].endswith(".json"):
    json.dump(out, open(sys.argv[-1], "w"), indent=1)
