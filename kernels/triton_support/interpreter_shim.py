"""Makes Triton's CPU interpreter (TRITON_INTERPRET=1) run fla's and our kernels.

Three gaps of the interpreter (triton 3.9, pinned in pyproject because this touches private
internals); each bites only under the interpreter, and none of this runs on a GPU:

1. `@triton.autotune` with several configs benchmarks them, which needs a GPU driver
   ("0 active drivers"). Keeping only the first config skips the benchmark.
2. The interpreter runs `for i in range(n)` / `tl.range` loops with plain Python ints as the
   loop variable, so kernel code such as fla's `i_t.to(tl.int64)` fails. The kernel's AST is
   rewritten so those loops yield Triton scalars, as compiled code sees them.
   `tl.static_range` loops keep Python ints: they are compile-time unrolled on a GPU too.
3. A comparison's result carries its operands' element type on the handle, so splatting a
   scalar condition (`block_mask & (slot >= 0)`) makes int64 data, and a load or store
   with that mask fails ("mask has unsupported dtype"). Splatted booleans stay booleans.

Call `install()` after setting TRITON_INTERPRET=1 and before any kernel first runs.
"""

from __future__ import annotations

import ast
import os

_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("the interpreter shim needs TRITON_INTERPRET=1 set before triton is imported")
    import numpy as np
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    original_prune = autotuner.Autotuner.prune_configs

    def first_config_only(self, kwargs):
        return original_prune(self, kwargs)[:1]

    autotuner.Autotuner.prune_configs = first_config_only

    def loop_values(iterable):
        for value in iterable:
            yield interpreter._implicit_cvt(value) if isinstance(value, int) else value

    # The rewritten kernel runs with the interpreter module's globals merged into its own.
    interpreter._hybrid_engine_loop_values = loop_values

    def visit_For(self, node):
        node = self.generic_visit(node)
        if _is_runtime_range(node.iter):
            node.iter = ast.Call(func=ast.Name(id="_hybrid_engine_loop_values", ctx=ast.Load()),
                                 args=[node.iter], keywords=[])
        return node

    interpreter.ASTTransformer.visit_For = visit_For
    builder = type(interpreter.interpreter_builder)
    original_splat = builder.create_splat

    def create_splat(self, ret_ty, arg):
        out = original_splat(self, ret_ty, arg)
        if arg.data.dtype == np.bool_ and out.data.dtype != np.bool_:
            out = interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)
        return out

    builder.create_splat = create_splat
    interpreter.InterpretedFunction.rewritten_fn.clear()   # anything rewritten before the shim
    _installed = True


def _is_runtime_range(call: ast.AST) -> bool:
    """`range(...)` or `tl.range(...)` (any module alias), but not `tl.static_range(...)`."""
    if not isinstance(call, ast.Call):
        return False
    func = call.func
    if isinstance(func, ast.Name):
        return func.id == "range"
    return isinstance(func, ast.Attribute) and func.attr == "range"
