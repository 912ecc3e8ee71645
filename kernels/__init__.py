"""The engine's kernels, one folder per op (norm/, rope/, activation/, attention/, conv/, gdn/,
linear/): each holds the op's torch reference, its native CPU form (`cpu.py` and its C++) where it
pays, and its triton form (`triton.py`). native/ builds the C++ of every op into one library of
torch operators; triton_support/ is what the triton forms share.

Ops take tensors and flags only; nothing here knows about models or the engine. An engine
takes its ops from one `KernelBackend` chosen at construction (kernels/backends.py:
`make_backend("auto" | "torch" | "cpu" | "triton", device)`); the public ops of this package
(kernels/ops.py) are the torch references.
"""

if __name__ == "kernels":
    # This folder is the package hybrid_engine.kernels. It is reached as a top-level `kernels`
    # only when a checkout's root is on sys.path (`python -m pytest` or `python -c` run there),
    # and then it would shadow the `kernels` distribution that transformers (>= 5.25) imports
    # at start-up. Hand that import the distribution, or fail as if this folder weren't here.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    _path = [p for p in sys.path if os.path.realpath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels'", name="kernels")
    _distribution = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _distribution
    _spec.loader.exec_module(_distribution)
else:
    from .ops import *  # noqa: F401,F403
    from .ops import __all__  # noqa: F401
