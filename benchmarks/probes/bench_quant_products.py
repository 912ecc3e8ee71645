"""Issue 39's first measurement: what torch's own CPU weight-only int8 and int4 products
(aten._weight_int8pack_mm: int8 per output channel; aten._weight_int4pack_mm_for_cpu: int4 in
groups) give at the 0.8B dims' projection shapes, against our float products (the cpu
backend's linear method: blocked float32, oneDNN/blocked bf16) and our own int8 / int4 kernels
(kernels/linear/quant_linear.cpp, bf16 activations), at decode row counts. Prints
microseconds per product (median of repeats) and the bandwidth of the weight bytes each reads.

    python benchmarks/probes/bench_quant_products.py [ROWS ...]     (default: 1 4)
Threads: torch's (set OMP_NUM_THREADS / AB_THREADS=2 as the benchmarks do). Level: the process's
(HYBRID_ENGINE_CPU_ISA lowers it)."""
import os
import statistics
import sys
import time

import torch

torch.set_num_threads(int(os.environ.get("AB_THREADS", "2")))

from hybrid_engine.kernels.linear.cpu import CpuLinearMethod  # noqa: E402
from hybrid_engine.kernels.linear.quantized import QuantizedLinearMethod  # noqa: E402
from hybrid_engine.kernels.native.isa import cpu_level  # noqa: E402
from hybrid_engine.models.linear import Linear  # noqa: E402

# (name, in, out) at Qwen3.5-0.8B dims: GDN in_proj_qkv, MLP gate_up and down, attention q+gate,
# lm_head (a third of the model's bytes)
SHAPES = [("gdn in_proj_qkv", 1024, 6144), ("mlp gate_up", 1024, 7168), ("mlp down", 3584, 1024),
          ("attn q+gate", 1024, 4096), ("lm_head", 1024, 248320)]
GROUP = 32


# Each timing cycles through copies of the weight holding at least this many bytes together, so
# that a product reads its weight from memory as a decode step does, not from the last call's cache.
ROTATE_BYTES = 256 << 20


def copies(nbytes: int) -> int:
    return max(1, -(-ROTATE_BYTES // nbytes))


def timed(fns, reps=30):
    """Median seconds of one call, cycling through `fns` (one per weight copy)."""
    for f in fns:
        f()
    times = []
    for i in range(reps):
        f = fns[i % len(fns)]
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def float_layer(w: torch.Tensor, method=None) -> Linear:
    with torch.device("meta"):
        layer = Linear(w.shape[1], w.shape[0], method=method or CpuLinearMethod())
    layer.weight_loader("w.weight", w)
    layer.process_weights_after_loading()
    return layer


def main():
    rows_list = [int(r) for r in sys.argv[1:]] or [1, 4]
    print(f"level {cpu_level()}, {torch.get_num_threads()} threads; us per product (GB/s of weight bytes read)")
    print(f"{'shape':18s} {'rows':>4s} {'fp32 ours':>18s} {'bf16 ours':>18s} {'int8 aten':>18s} {'int4 g32 aten':>18s} {'int8 g32 ours':>18s} {'int4 g32 ours':>18s}")
    g = torch.Generator().manual_seed(0)
    for name, k, n in SHAPES:
        w = torch.randn(n, k, generator=g) * 0.02
        scale = w.abs().amax(1) / 127
        w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        # int4 with group scales and zero points (asymmetric 0..15 around 8), as the aten op takes them
        wg = w.view(n, k // GROUP, GROUP)
        s4 = wg.abs().amax(2) / 7
        q4 = (torch.round(wg / s4[..., None]).clamp(-8, 7) + 8).to(torch.int32).view(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4, 1)
        layers = {dt: [float_layer(w.to(dt)) for _ in range(copies(n * k * dt.itemsize))]
                  for dt in (torch.float32, torch.bfloat16)}
        w8s = [w8.clone() for _ in range(copies(n * k))]
        packs = [packed.clone() for _ in range(copies(n * k // 2))]
        ours = {bits: [float_layer(w, QuantizedLinearMethod(bits, GROUP, native=True))
                       for _ in range(copies(n * k * bits // 8))] for bits in (8, 4)}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=g)
            cells = []
            for dt, nbytes in ((torch.float32, 4), (torch.bfloat16, 2)):
                xd = x.to(dt)
                t = timed([lambda layer=layer: layer(xd) for layer in layers[dt]])
                cells.append((t, n * k * nbytes))
            xb = x.to(torch.bfloat16)
            s8 = scale.to(torch.bfloat16)
            t = timed([lambda q=q: torch.ops.aten._weight_int8pack_mm(xb, q, s8) for q in w8s])
            cells.append((t, n * k + n * 2))
            sz = torch.stack([s4.t(), torch.zeros_like(s4).t()], -1).contiguous().to(torch.bfloat16)
            t = timed([lambda q=q: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, q, GROUP, sz) for q in packs])
            cells.append((t, n * k // 2 + (k // GROUP) * n * 4))
            for bits in (8, 4):
                t = timed([lambda layer=layer: layer(xb) for layer in ours[bits]])
                cells.append((t, n * k * bits // 8 + (k // GROUP) * n * 2))
            print(f"{name:18s} {rows:4d} " + " ".join(f"{t * 1e6:9.1f} ({b / t / 1e9:5.1f})" for t, b in cells))
        # the quantized products agree with the dequantized weights (a check, not a timing)
        xb = torch.randn(2, k, generator=g).to(torch.bfloat16)
        ref8 = xb.float() @ (w8.float() * scale[:, None]).t()
        got8 = torch.ops.aten._weight_int8pack_mm(xb, w8, scale.to(torch.bfloat16)).float()
        ref4 = xb.float() @ ((q4.float() - 8).view(n, k // GROUP, GROUP) * s4[..., None]).view(n, k).t()
        got4 = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz).float()
        for label, got, ref in (("int8", got8, ref8), ("int4", got4, ref4)):
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if err > 0.02:
                raise SystemExit(f"{name}: aten {label} product is off its dequantized reference by {err:.3f}")


if __name__ == "__main__":
    main()
