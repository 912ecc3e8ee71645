"""The triton backend's tests: their own pytest process (see .ci/run_triton).

Without a GPU the kernels run under Triton's CPU interpreter, which must be switched on
before triton (or fla) is first imported, plus the project's shim for the interpreter's two
gaps (kernels/triton_support/interpreter_shim.py). With a GPU the same tests run compiled.
The default test run leaves this folder out (tests/conftest.py, HYBRID_ENGINE_TRITON_TESTS).
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))    # triton_cases.py (importlib mode adds no path)

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before tests/triton/conftest.py could set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
    from hybrid_engine.kernels.triton_support.interpreter_shim import install

    install()
    torch.set_num_threads(1)          # the interpreter is numpy-bound; a shared 2-core box

import pytest  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


def pytest_configure(config):
    # masked-out lanes overflow exp2 in the interpreter; fla warns that it runs on CPU and
    # trips torch.jit's deprecation warning at import
    for line in ("ignore::RuntimeWarning:triton.runtime.interpreter",
                 "ignore:Triton is not supported:UserWarning",
                 "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"):
        config.addinivalue_line("filterwarnings", line)


@pytest.fixture
def device():
    return DEVICE
