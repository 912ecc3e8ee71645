"""The projections' linear methods: how each weight is laid out after loading and multiplied.

    reference.py          the interface (`LinearMethod`) and its plain-weight reference, the
                          `torch` and `triton` backends' method
    cpu.py                the `cpu` backend's method (`CpuLinearMethod`): each weight's layout
                          chosen once after loading
    blocked.py            the native blocked product (blocked_linear.cpp) and its torch reference
"""

from .reference import LinearMethod, plain_linear

__all__ = ["LinearMethod", "plain_linear"]
