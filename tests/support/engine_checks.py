"""Checks every engine test makes after a run."""

from __future__ import annotations


def assert_no_leak(engine) -> None:
    """Nothing left running, every KV block and state slot back in the pools (cached blocks
    nobody holds count as free), and no prefix checkpoint still owned by a request."""
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == engine.cache.num_blocks
    assert engine.cache.num_free_slots == engine.cache.num_slots
    pool = engine.cache.checkpoints
    assert pool.num_pending == 0 and pool.num_free + len(pool.published()) == pool.size


def budget_for_blocks(engine, num_blocks: int) -> int:
    """A cache_memory_bytes that gives an engine configured as `engine` (max_num_seqs,
    speculation, prefix caching) exactly num_blocks KV blocks: its state slots (the pad slot
    included) and prefix checkpoints, plus the blocks."""
    u = engine.cache.usage()
    return u["state_bytes_total"] + u["checkpoint_bytes_total"] + num_blocks * engine.cache.spec.bytes_per_block
