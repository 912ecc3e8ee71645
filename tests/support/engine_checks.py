"""Checks every engine test makes after a run."""

from __future__ import annotations


def assert_no_leak(engine) -> None:
    """Nothing left running, and every KV block and state slot back in the pools."""
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.cache.num_free_slots == engine.cache.num_slots
