"""What the op folders' triton forms share: launch-side checks (common.py) and the patches that let
Triton's CPU interpreter run them and fla's kernels (interpreter_shim.py, for tests/triton)."""
