"""Two trees' decode kernels in one process: the GDN decode op (kernels/gdn/gdn_decode.cpp with
its delta_rule.h) or paged attention decode (kernels/attention/paged_attention.cpp), each tree's
source built alone into a small library with the native build's compiler and flags for this
process's level, both loaded with ctypes and called through their C entries, timed in
alternating rounds. A round calls every layer of a 0.8B-dims step once (18 GDN layers, each its
own 1 MB state; or 6 attention layers, each its own KV of CONTEXT tokens in scattered blocks),
after a 48 MB write that pushes them out of the caches, as a step's weights do.

    python benchmarks/probes/ab_decode_kernels.py TREE_A TREE_B gdn|attention [--context 320]
        [--rounds 60] [--in-place] [--json F]

A tree is a folder holding kernels/ or a git revision of this repository. --in-place: the GDN
state is written back to the slot it is read from (a plain decode step; otherwise to another
slot, as a verify step writes each token's). Prints both medians, B's time over A's, and whether
the two builds' outputs are bitwise equal (with --in-place the states move on between calls, so
only the timing compares).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # benchmarks/: bench_llamacpp
from bench_llamacpp import cpu_record  # noqa: E402

from hybrid_engine.kernels.native import build  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SOURCES = {"gdn": ["gdn/gdn_decode.cpp"], "attention": ["attention/paged_attention.cpp"]}


def kernels_of(tree: str, scratch: Path) -> Path:
    """The kernels/ folder of a tree: a folder as given, or a revision extracted with git archive."""
    if Path(tree, "kernels").is_dir():
        return Path(tree, "kernels")
    out = scratch / tree.replace("/", "_")
    out.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", tree, "kernels"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive.stdout, check=True)
    return out / "kernels"


def library(kernels: Path, which: str, out: Path, level: str) -> ctypes.CDLL:
    flags = [*build.KERNEL_FLAGS, *build.LEVEL_FLAGS[level], f"-I{kernels}", "-shared"]
    subprocess.run([build._compiler(), *flags, "-o", str(out), *(str(kernels / s) for s in SOURCES[which])],
                   check=True)
    return ctypes.CDLL(str(out), mode=ctypes.RTLD_LOCAL)


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def gdn_calls(args, g):
    """The 0.8B dims' GDN decode: 16 key and value heads of 128 x 128, bf16 activations."""
    H = Hk = 16
    dk = dv = 128
    D = 2 * Hk * dk + H * dv
    u = torch.randn(1, 1, D, generator=g).bfloat16()
    b, a = torch.randn(1, 1, H, generator=g).bfloat16(), torch.randn(1, 1, H, generator=g).bfloat16()
    dt_bias, neg_decay = torch.randn(H, generator=g), -torch.rand(H, generator=g)
    pools = [torch.randn(2, H, dk, dv, generator=g) * 0.01 for _ in range(18)]
    read, write = torch.tensor([1]), torch.tensor([1 if args.in_place else 0])
    i64, f32 = ctypes.c_int64, ctypes.c_float

    def call(lib, layer, out):
        pool = pools[layer]
        return lib.gdn_decode_bf16(ptr(u), ptr(b), ptr(a), i64(H), i64(H), i64(H), i64(H), ptr(dt_bias),
                                   ptr(neg_decay), ptr(pool), i64(2), ptr(pool), i64(2), ptr(read), ptr(write),
                                   ptr(out), 1, 1, Hk, H, dk, dv, f32(dk ** -0.5), torch.get_num_threads())
    return call, len(pools), lambda: torch.zeros(1, 1, H, dv, dtype=torch.bfloat16)


def attention_calls(args, g):
    """The 0.8B dims' attention decode: 8 query heads on 2 kv heads of 256, bf16 KV, blocks of 16."""
    nh, nkv, hd, bs, L = 8, 2, 256, 16, args.context
    nb = (L + bs - 1) // bs
    caches = [torch.randn(2 * nb, 2, bs, nkv, hd, generator=g).bfloat16() for _ in range(6)]
    tables = [torch.randperm(2 * nb, generator=g)[:nb].view(1, nb).contiguous() for _ in range(6)]
    q, lens = torch.randn(1, nh, hd, generator=g), torch.tensor([L])

    def call(lib, layer, out):
        cache = caches[layer]
        return lib.paged_attention_bf16(ptr(q), ptr(cache), ptr(tables[layer]), ptr(lens), ptr(out),
                                        ctypes.c_int64(cache.shape[0]), 1, 1, nh, nkv, hd, bs, nb,
                                        ctypes.c_float(hd ** -0.5), torch.get_num_threads())
    return call, len(caches), lambda: torch.zeros(1, nh, hd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tree_a")
    ap.add_argument("tree_b")
    ap.add_argument("kernel", choices=sorted(SOURCES))
    ap.add_argument("--context", type=int, default=320, help="attention: cached tokens")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--in-place", action="store_true", help="gdn: the state written back to its own slot")
    ap.add_argument("--json")
    args = ap.parse_args()
    level = cpu_level()
    if level not in build.LEVEL_FLAGS:
        sys.exit(f"no native kernels at level {level}")
    with tempfile.TemporaryDirectory() as tmp:
        libs = {side: library(kernels_of(tree, Path(tmp)), args.kernel, Path(tmp, f"{side}.so"), level)
                for side, tree in (("A", args.tree_a), ("B", args.tree_b))}
        g = torch.Generator().manual_seed(0)
        call, layers, output = (gdn_calls if args.kernel == "gdn" else attention_calls)(args, g)
        outs = {side: output() for side in libs}
        evict = torch.empty(48 * 2**20 // 4)
        times = {side: [] for side in libs}
        for r in range(args.rounds):
            for side in ("AB" if r % 2 == 0 else "BA"):
                evict.add_(1.0)
                t = time.perf_counter()
                for layer in range(layers):
                    if call(libs[side], layer, outs[side]) != 0:
                        sys.exit(f"{side}: the kernel refused the call")
                times[side].append((time.perf_counter() - t) / layers * 1e6)
    a, b = statistics.median(times["A"]), statistics.median(times["B"])
    equal = torch.equal(outs["A"], outs["B"])
    print(f"{args.kernel} at {level}, {torch.get_num_threads()} threads: A {a:.1f} us a layer, B {b:.1f}, "
          f"B / A {b / a:.3f}; outputs bitwise equal: {equal}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(["python"] + sys.argv), "cpu": cpu_record(), "level": level,
            "threads": torch.get_num_threads(), "median_us_a": a, "median_us_b": b, "ratio": b / a,
            "outputs_equal": equal, "times_us": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()
