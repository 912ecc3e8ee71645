"""The prefix cache's memory (state_cache/prefix_blocks.py, checkpoints.py, prefix_store.py and the
manager's verbs with a hit): random requests over a small alphabet (so prefixes repeat), hits, forks (n samples),
aborts, preemption and eviction under a pool too small for them all. The simulated model writes each token id
into its KV position and a function of the prefix into the GDN slot, so the test can see
what a hit hands over and whether a cached block ever changes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_engine.state_cache import CacheSpec, HybridCacheManager, chain_hashes

BS = 4


def spec() -> CacheSpec:
    return CacheSpec(num_attention_layers=2, num_kv_heads=1, head_dim=1, block_size=BS, kv_dtype=torch.float32,
                     num_gdn_layers=2, conv_dim=1, conv_kernel=2, num_v_heads=1, key_head_dim=1,
                     value_head_dim=1, conv_dtype=torch.float32, hidden_size=1)


def prefix_state(tokens) -> float:
    """What the simulated GDN state holds after `tokens`: exact in float32 for these sizes."""
    return float(len(tokens) * 1000 + sum((i % 7 + 1) * t for i, t in enumerate(tokens)))


class Sim:
    def __init__(self, num_blocks: int, num_slots: int, num_checkpoints: int, copy_last: bool):
        self.m = HybridCacheManager(spec(), num_blocks, num_slots, num_checkpoints=num_checkpoints,
                                    copy_last_hit_block=copy_last)
        self.tokens: dict[str, list[int]] = {}
        self.block_tokens: dict[bytes, tuple[int, ...]] = {}   # chain hash -> the block's tokens
        self.hit_tokens = 0

    def hashes(self, tokens):
        hs = chain_hashes(tokens, BS)
        for i, h in enumerate(hs):
            self.block_tokens[h] = tuple(tokens[i * BS:(i + 1) * BS])
        return hs

    def kv_token(self, rid, pos) -> list[float]:
        rc = self.m.get(rid)
        block, off = rc.block_table[pos // BS], pos % BS
        return [kv[block, 0, off, 0, 0].item() for kv in self.m.pools.kv_caches]

    def admit(self, rid, tokens) -> None:
        hs = self.hashes(tokens)
        hit = self.m.prefix_store.match(hs, len(tokens) - 1)
        before = self.state()
        rc = self.m.allocate(rid, len(tokens), 1, hit)
        if rc is None:                                     # refused: nothing changed
            assert self.state() == before
            return
        self.tokens[rid] = list(tokens)
        if hit is not None:
            self.hit_tokens += hit.num_tokens
            assert rc.num_committed_tokens == hit.num_tokens
            for pos in range(hit.num_tokens):              # the hit's KV is this prompt's prefix
                assert self.kv_token(rid, pos) == [float(tokens[pos])] * 2
            expect = prefix_state(tokens[:hit.num_tokens])
            assert [r[rc.slot].item() for r in self.m.pools.recurrent_states] == [expect] * 2
            assert [c[rc.slot].item() for c in self.m.pools.conv_states] == [expect] * 2

    def fork(self, src, dst) -> None:
        """The n samples of one prompt: dst takes src's committed prefix (its cached blocks
        shared, the rest copied) and goes on with the same tokens."""
        tokens = self.tokens[src]
        before = self.state()
        rc = self.m.fork(src, dst, 1, room_for=len(tokens))   # the scheduler's check: room for its prompt too
        if rc is None:                                     # refused: nothing changed
            assert self.state() == before
            return
        assert self.m.grow(dst, len(tokens))
        self.tokens[dst] = list(tokens)
        committed = rc.num_committed_tokens
        for pos in range(committed):
            assert self.kv_token(dst, pos) == [float(self.tokens[dst][pos])] * 2
        if committed:
            expect = prefix_state(self.tokens[dst][:committed])
            assert [r[rc.slot].item() for r in self.m.pools.recurrent_states] == [expect] * 2

    def advance(self, rid, n, pending) -> None:
        """The model computes n more tokens (a prefill chunk or decodes), then the step commits."""
        rc, toks = self.m.get(rid), self.tokens[rid]
        start = rc.num_committed_tokens
        end = min(start + n, len(toks))
        for pos in range(start, end):
            block, off = rc.block_table[pos // BS], pos % BS
            assert self.m._blocks.hash_of(block) is None, "a cached block is being written"
            for kv in self.m.pools.kv_caches:
                kv[block, 0, off] = float(toks[pos])
        state = prefix_state(toks[:end])
        for conv, rec in zip(self.m.pools.conv_states, self.m.pools.recurrent_states):
            conv[rc.slot] = state
            rec[rc.slot] = state
        self.m.commit(rid, end)
        hs = self.hashes(toks)
        self.m.prefix_store.cache_blocks(rid, hs)
        if end and end % BS == 0:
            self.m.prefix_store.save_checkpoint(rid, end, hs[end // BS - 1], rc.slot, torch.ones(1), pending=pending)

    def decode_token(self, rid, tok) -> None:
        rc = self.m.get(rid)
        if rc.num_committed_tokens < len(self.tokens[rid]):
            return
        if not self.m.grow(rid, len(self.tokens[rid]) + 1):
            return self.free(rid)                          # preempted by recompute
        self.tokens[rid].append(tok)

    def free(self, rid) -> None:
        self.m.free(rid)
        del self.tokens[rid]

    def state(self) -> tuple:
        """Who holds what, and the cache's counts: a refused verb leaves them as they were."""
        held = {rid: (tuple(c.block_table), c.slot, tuple(c.draft_slots), c.num_tokens, c.num_committed_tokens)
                for rid in self.tokens for c in [self.m.get(rid)]}
        blocks = self.m._blocks
        return held, self.m.usage(), [(blocks.ref_count(b), blocks.hash_of(b)) for b in range(self.m.num_blocks)]

    def check(self) -> None:
        m, blocks = self.m, self.m._blocks
        holders: dict[int, int] = {}
        for rid in self.tokens:
            for b in m.get(rid).block_table:
                holders[b] = holders.get(b, 0) + 1
        for b in range(m.num_blocks):
            assert blocks.ref_count(b) == holders.get(b, 0), "a held block was freed (or a count is off)"
            h = blocks.hash_of(b)
            if h is not None:                               # a cached block's tokens never change
                assert [kv[b, 0, :, 0, 0].tolist() for kv in m.pools.kv_caches] == \
                    [[float(t) for t in self.block_tokens[h]]] * 2
        u = m.usage()
        assert u["blocks_used"] == len(holders) and u["blocks_free"] + u["blocks_used"] == m.num_blocks
        assert m.num_free_slots + 2 * len(self.tokens) == m.num_slots


op = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, 3), st.lists(st.integers(0, 2), min_size=1, max_size=14)),
    st.tuples(st.just("advance"), st.integers(0, 7), st.integers(1, 9), st.booleans()),
    st.tuples(st.just("decode"), st.integers(0, 7), st.integers(0, 2)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("fork"), st.integers(0, 7)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=150, deadline=None)
@given(ops=st.lists(op, max_size=60), num_blocks=st.integers(4, 12), num_checkpoints=st.integers(1, 4),
       copy_last=st.booleans())
def test_random_requests_hits_aborts_preemption_eviction(ops, num_blocks, num_checkpoints, copy_last):
    sim = Sim(num_blocks, 8, num_checkpoints, copy_last)
    shared_prefixes = [[0, 1, 2, 0, 1, 2, 0, 1], [2, 2, 1, 1, 0, 0, 2, 2], [1] * 8, []]
    next_id = 0
    for o in ops:
        live = sorted(sim.tokens)
        if o[0] == "admit":
            sim.admit(f"r{next_id}", shared_prefixes[o[1]] + o[2])
            next_id += 1
        elif live and o[0] == "advance":
            sim.advance(live[o[1] % len(live)], o[2], o[3])
        elif live and o[0] == "decode":
            sim.decode_token(live[o[1] % len(live)], o[2])
        elif live and o[0] == "free":
            sim.free(live[o[1] % len(live)])
        elif o[0] == "reset":                           # forgets only what nobody holds
            sim.m.prefix_store.reset()
            assert sim.m.usage()["blocks_cached_idle"] == sim.m.usage()["checkpoints_published"] == 0
        elif live and o[0] == "fork":
            sim.fork(live[o[1] % len(live)], f"r{next_id}")
            next_id += 1
        sim.check()
    for rid in sorted(sim.tokens):
        sim.free(rid)
    sim.check()
    m = sim.m
    assert (m.num_free_blocks, m.num_free_slots) == (m.num_blocks, m.num_slots)
    assert m.prefix_store.checkpoints.num_pending == 0
    assert m.prefix_store.checkpoints.num_free + len(m.prefix_store.checkpoints.published()) == m.prefix_store.checkpoints.size


def test_hits_happen_and_shared_blocks_count_once():
    sim = Sim(num_blocks=8, num_slots=8, num_checkpoints=2, copy_last=False)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1, 2]
    sim.admit("a", prompt)
    sim.advance("a", 8, pending=False)                  # checkpoint at 8 = 2 blocks
    assert sim.m.num_free_blocks == 5
    sim.admit("b", prompt[:8] + [2, 2])                 # hits 8 tokens; needs 1 block of its own
    assert sim.hit_tokens == 8 and sim.m.get("b").block_table[:2] == sim.m.get("a").block_table[:2]
    assert sim.m.num_free_blocks == 4
    sim.check()
    sim.free("a")
    sim.free("b")
    assert sim.m.usage()["blocks_cached_idle"] == 2 and sim.m.num_free_blocks == 8
    # Idle cached blocks are evicted, deepest first, only once free ones run out.
    sim.admit("c", [1] * 24)
    assert sim.m.usage()["blocks_cached_idle"] == 2
    sim.admit("d", [2] * 4)
    assert sim.m.usage()["blocks_cached_idle"] == 1 and sim.m.prefix_store.match(chain_hashes(prompt, BS), 8) is None
    sim.check()
    sim.advance("c", 8, pending=False)                  # cached and checkpointed while c holds them
    sim.m.prefix_store.reset()
    hit = sim.m.prefix_store.match(chain_hashes([1] * 24, BS), 23)
    assert hit is None and sim.m.prefix_store.num_cached_blocks(chain_hashes([1] * 24, BS)) == 2
    assert sim.m.usage()["blocks_cached_idle"] == 0 and sim.m.prefix_store.checkpoints.num_free == sim.m.prefix_store.checkpoints.size
    sim.check()


def test_stale_hits_and_bad_checkpoints_are_refused():
    sim = Sim(num_blocks=4, num_slots=4, num_checkpoints=1, copy_last=False)
    sim.admit("a", [0] * 5)
    sim.advance("a", 4, pending=False)
    hit = sim.m.prefix_store.match(chain_hashes([0] * 5, BS), 4)
    assert hit is not None and hit.num_tokens == 4
    with pytest.raises(ValueError, match="slot"):
        sim.m.prefix_store.save_checkpoint("a", 4, b"k", 99)
    with pytest.raises(ValueError, match="block boundary"):
        sim.m.prefix_store.save_checkpoint("a", 3, b"k", sim.m.get("a").slot)
    with pytest.raises(ValueError, match="cannot start"):
        sim.m.allocate("b", 4, 0, hit)                  # a hit must leave a token to compute
    sim.free("a")
    sim.admit("c", [1] * 16)                             # evicts the cached block
    with pytest.raises(ValueError, match="stale"):
        sim.m.allocate("b", 5, 0, hit)
    assert "b" not in sim.m


def test_a_fork_shares_the_cached_blocks_and_copies_the_partial_one():
    sim = Sim(num_blocks=8, num_slots=8, num_checkpoints=2, copy_last=False)
    sim.admit("a", [0, 1, 2, 0, 1, 2, 0, 1, 2, 1])
    sim.advance("a", 9, pending=False)                  # 2 full cached blocks + 1 partial
    free = sim.m.num_free_blocks
    sim.fork("a", "b")
    a, b = sim.m.get("a").block_table, sim.m.get("b").block_table
    assert b[:2] == a[:2] and b[2] != a[2]
    assert sim.m.num_free_blocks == free - 1
    assert [sim.m._blocks.ref_count(x) for x in a] == [2, 2, 1]
    sim.check()
    sim.advance("b", 1, pending=False)                  # writes only its own copy
    sim.check()
    sim.free("a")
    sim.free("b")
    assert sim.m.num_free_blocks == sim.m.num_blocks and sim.m.usage()["blocks_cached_idle"] == 2
