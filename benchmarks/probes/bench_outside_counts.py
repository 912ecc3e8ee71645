"""Work outside the model forward per decode step, counted (issue 15): aten ops dispatched,
Python calls made and Python bytecodes executed between forwards, at batch 1 and 16 on the
default model. Counts do not move with the machine's load, unlike bench_engine.py's timings;
run it in two checkouts to A/B them. Bytecodes also see work that makes no call (loops,
attribute reads) and calls the profiler does not report (a functools.partial's target).

    python benchmarks/probes/bench_outside_counts.py [--batches 1,16] [--steps 64] [--top 0] [--compile]

--top N also lists the N most frequent aten ops (with the engine function that issued them)
and Python functions. --compile counts the torch.compile'd engine (its graphs compiled in the
first steps of each batch): outside is then everything but the compiled graphs themselves,
dynamo's entry included (its prologue's bytecode counts; its guards run in C++, uncounted), and
aten ops are not counted (dynamo would compile the step again under the counting dispatch mode).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/: bench_cpu
from bench_cpu import DECODE_PROMPT_LEN, make_engine, prompts  # noqa: E402

from hybrid_engine.default_model import default_model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=0)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from hybrid_engine import SamplingParams

    torch.set_num_threads(1)
    inside = [False]
    if args.compile:
        _count_inside_graphs(inside)
    engine = make_engine(str(default_model_path()), "float32", 16, compile=args.compile)
    vocab = engine.model_config.vocab_size
    forward = type(engine.runner).forward.__get__(engine.runner)

    def marked_forward(inputs):
        inside[0] = True
        try:
            return forward(inputs)
        finally:
            inside[0] = False

    if not args.compile:
        engine.runner.forward = marked_forward
    ops, calls = collections.Counter(), collections.Counter()

    def caller() -> str:
        f = sys._getframe(2)
        while f is not None and ("torch" + os.sep in f.f_code.co_filename or f.f_code.co_filename == __file__):
            f = f.f_back
        return f"{os.path.basename(f.f_code.co_filename)}:{f.f_code.co_name}" if f is not None else "?"

    class CountOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not inside[0]:
                ops[(str(func), caller())] += 1
            return func(*args, **(kwargs or {}))

    bytecodes = [0]

    def count_bytecodes(frame, event, arg):
        if inside[0]:
            return None
        frame.f_trace_opcodes = True
        if event == "opcode":
            bytecodes[0] += 1
        return count_bytecodes

    def count_call(frame, event, arg):
        if inside[0]:
            return
        if event == "call":
            calls[f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            calls[f"C {getattr(arg, '__qualname__', arg)}"] += 1

    print(f"default model, float32{', compiled' if args.compile else ''}, per decode step outside the "
          f"{'compiled graphs' if args.compile else 'forward'}, mean over {args.steps} steps")
    for b in [int(x) for x in args.batches.split(",")]:
        params = SamplingParams(temperature=0.0, max_tokens=3 * args.steps + 9, ignore_eos=True)
        for p in prompts(vocab, b, DECODE_PROMPT_LEN, 0):
            engine.add_request(p, params)
        for _ in range(8):                            # the prefill and the first decodes
            engine.step()
        if not args.compile:        # under a dispatch mode dynamo would trace the step again
            with CountOps():
                for _ in range(args.steps):
                    engine.step()
        sys.setprofile(count_call)
        for _ in range(args.steps):
            engine.step()
        sys.setprofile(None)
        sys.settrace(count_bytecodes)
        for _ in range(args.steps):
            engine.step()
        sys.settrace(None)
        while engine.has_unfinished_requests():
            engine.step()
        print(f"batch {b:>2}: aten ops {sum(ops.values()) / args.steps:6.1f}, "
              f"Python calls {sum(calls.values()) / args.steps:7.1f}, "
              f"Python bytecodes {bytecodes[0] / args.steps:8.0f}")
        for (op, where), n in ops.most_common(args.top):
            print(f"    {n / args.steps:6.2f}  {op:36s} {where}")
        for name, n in calls.most_common(args.top):
            print(f"    {n / args.steps:6.2f}  {name}")
        ops.clear()
        calls.clear()
        bytecodes[0] = 0


def _count_inside_graphs(inside: list[bool]) -> None:
    """Marks the calls of the graphs compiled_steps' backend returns as inside (before the
    engine is made): dynamo's entry and everything around it stays outside."""
    import hybrid_engine.compiled_steps as cs
    backend_for = cs._inductor

    def marking_backend_for(freeze: bool):
        backend = backend_for(freeze)

        def marking_backend(graph, example_inputs):
            compiled = backend(graph, example_inputs)

            def marked(*args):
                inside[0] = True
                try:
                    return compiled(*args)
                finally:
                    inside[0] = False
            return marked
        return marking_backend
    cs._inductor = marking_backend_for


if __name__ == "__main__":
    main()
