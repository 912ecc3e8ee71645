"""Run from a checkout's root (`python -m pytest`, `python -c`), the root is on sys.path and the
folder kernels/ (the package hybrid_engine.kernels) could shadow the `kernels` distribution that
transformers imports at start-up: every transformers model import then failed."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_at_root(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_top_level_kernels_is_the_distribution_at_a_checkouts_root():
    out = _run_at_root(
        "import sys, importlib.metadata as m\n"
        "print(sys.path[0] == '')\n"
        "print(any(d.metadata['Name'] == 'kernels' for d in m.distributions()))\n"
        "try:\n"
        "    import kernels\n"
        "    print(kernels.__file__)\n"
        "except ModuleNotFoundError:\n"
        "    print('missing')\n"
    ).split("\n")
    assert out[0] == "True"  # the root really is on sys.path here
    installed, found = out[1] == "True", out[2]
    # The distribution where it is installed (transformers >= 5.25 requires it), else no module.
    assert (found != "missing") == installed, out
    assert not found.startswith(str(ROOT / "kernels")), found


def test_transformers_models_and_the_engines_kernels_import_at_a_checkouts_root():
    out = _run_at_root(
        "from transformers.models.qwen3_5 import modeling_qwen3_5\n"
        "import hybrid_engine.kernels as k\n"
        "print(k.__file__)\n"
        "print(callable(k.paged_attention) and callable(k.make_backend))\n"
    ).split("\n")
    assert Path(out[0]).resolve() == ROOT / "kernels" / "__init__.py"
    assert out[1] == "True"
