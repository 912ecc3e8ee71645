"""For tests of code that may hang: a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import pytest

T = TypeVar("T")


def within(seconds: float, fn: Callable[[], T]) -> T:
    """fn()'s result, or its exception raised here; the test fails if fn has not returned after
    `seconds` (it runs on a daemon thread, left behind blocked, which does not hold up exit)."""
    result: list = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as e:   # handed to the test's thread
            result.append((False, e))

    thread = threading.Thread(target=run, name="watchdog", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still blocked after {seconds} s: {getattr(fn, '__name__', fn)}")
    ok, value = result[0]
    if not ok:
        raise value
    return value
