"""state_cache: each verb, its errors, the budget arithmetic, and random op sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hybrid_engine.state_cache.id_pool import IdPool
from hybrid_engine.state_cache import (
    CacheCapacityError,
    CacheSpec,
    CheckpointPool,
    HybridCacheManager,
)

BLOCK_SIZE = 4


def tiny_spec(**overrides) -> CacheSpec:
    fields = dict(
        num_attention_layers=2, num_kv_heads=2, head_dim=8, block_size=BLOCK_SIZE, kv_dtype=torch.bfloat16,
        num_gdn_layers=3, conv_dim=12, conv_kernel=4,
        num_v_heads=2, key_head_dim=4, value_head_dim=6, conv_dtype=torch.bfloat16,
    )
    return CacheSpec(**(fields | overrides))


def tensor_bytes(manager: HybridCacheManager) -> int:
    pools = manager.pools
    tensors = pools.kv_caches + pools.conv_states + pools.recurrent_states
    return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(manager: HybridCacheManager, request_ids) -> tuple:
    held = {}
    for rid in filter(manager.__contains__, request_ids):
        c = manager.get(rid)
        held[rid] = (tuple(c.block_table), c.slot, tuple(c.draft_slots), c.num_tokens, c.num_committed_tokens)
    return held, manager.num_free_blocks, manager.num_free_slots


# -- spec ---------------------------------------------------------------------------------


def test_spec_bytes_count_every_layer_and_both_kinds():
    spec = tiny_spec()
    assert spec.bytes_per_block == 2 * (2 * BLOCK_SIZE * 2 * 8) * 2  # layers * (K,V * tokens * heads * dim) * bf16
    assert spec.bytes_per_slot == 3 * (12 * 3 * 2 + 2 * 4 * 6 * 4)  # layers * (conv bf16 + state fp32)
    assert spec.blocks_for(0) == 0 and spec.blocks_for(4) == 1 and spec.blocks_for(5) == 2


def test_spec_rejects_nonsense_sizes():
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        tiny_spec(block_size=0)
    with pytest.raises(ValueError, match="conv_kernel must be an int >= 2"):
        tiny_spec(conv_kernel=1)
    assert tiny_spec(num_gdn_layers=0).bytes_per_slot == 0


# -- allocators ---------------------------------------------------------------------------


@pytest.mark.parametrize("allocator_cls, kind", [(lambda n: IdPool(n, "KV block"), "KV block"),
                                                 (lambda n: IdPool(n, "state slot"), "state slot")])
def test_allocator_contract(allocator_cls, kind):
    pool = allocator_cls(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(CacheCapacityError, match=f"asked for 2 {kind}s but only 1 of 4 are free"):
        pool.allocate(2)
    assert pool.num_free == 1  # refusal changed nothing
    b = pool.allocate(1)
    assert set(a).isdisjoint(b) and pool.num_free == 0
    pool.free(a)
    for block in a:
        with pytest.raises(ValueError, match="not allocated"):
            pool.free([block])  # double free
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([99])  # never existed
    with pytest.raises(ValueError, match="more than once"):
        pool.free([b[0], b[0]])
    assert pool.num_free == 3  # the refused frees released nothing, not even b
    pool.free(b)
    assert pool.num_free == 4 and sorted(pool.allocate(4)) == [0, 1, 2, 3]


# -- manager: memory ------------------------------------------------------------------------


def test_tensors_have_the_documented_shapes_and_are_zero():
    spec = tiny_spec()
    m = HybridCacheManager(spec, num_blocks=5, num_slots=3)
    assert len(m.pools.kv_caches) == 2 and len(m.pools.conv_states) == 3 and len(m.pools.recurrent_states) == 3
    for kv in m.pools.kv_caches:
        assert kv.shape == (5, 2, BLOCK_SIZE, 2, 8) and kv.dtype == torch.bfloat16
    for conv in m.pools.conv_states:
        assert conv.shape == (4, 12, 3) and conv.dtype == torch.bfloat16      # 3 slots + pad_slot
    for state in m.pools.recurrent_states:
        assert state.shape == (4, 2, 4, 6) and state.dtype == torch.float32
    assert all(not t.any() for t in m.pools.kv_caches + m.pools.conv_states + m.pools.recurrent_states)
    assert tensor_bytes(m) == 5 * spec.bytes_per_block + 4 * spec.bytes_per_slot
    # one tensor per layer, not views of one another
    assert m.pools.kv_caches[0].data_ptr() != m.pools.kv_caches[1].data_ptr()


def test_slot_contents_survive_free_and_reallocate():
    m = HybridCacheManager(tiny_spec(), num_blocks=2, num_slots=1)
    slot = m.allocate("a", 1).slot
    m.pools.recurrent_states[0][slot].fill_(7.0)
    m.free("a")
    assert m.allocate("b", 1).slot == slot
    assert (m.pools.recurrent_states[0][slot] == 7.0).all()  # not zeroed: has_initial_state=False is the model's job


# -- manager: verbs -----------------------------------------------------------------------


def test_allocate_get_free():
    m = HybridCacheManager(tiny_spec(), num_blocks=8, num_slots=4)
    cache = m.allocate("a", 9, num_draft_slots=2)
    assert len(cache.block_table) == 3 and cache.num_tokens == 9 and len(cache.draft_slots) == 2
    assert len({cache.slot, *cache.draft_slots}) == 3
    assert m.get("a") is cache and "a" in m and "b" not in m
    assert (m.num_free_blocks, m.num_free_slots) == (5, 1)
    with pytest.raises(ValueError, match="'a' already holds cache memory"):
        m.allocate("a", 1)
    m.free("a")
    assert (m.num_free_blocks, m.num_free_slots) == (8, 4) and "a" not in m
    with pytest.raises(KeyError, match="'a' holds no cache memory"):
        m.free("a")
    with pytest.raises(KeyError, match="'zz' holds no cache memory"):
        m.get("zz")


def test_admission_needs_both_kinds():
    m = HybridCacheManager(tiny_spec(), num_blocks=4, num_slots=2)
    assert m.allocate("r", 17) is None  # 5 blocks > 4
    assert m.allocate("r", 4, num_draft_slots=2) is None  # 3 slots > 2
    assert (m.num_free_blocks, m.num_free_slots) == (4, 2) and "r" not in m   # refusals changed nothing
    assert m.allocate("r", 16, num_draft_slots=1) is not None
    assert (m.num_free_blocks, m.num_free_slots) == (0, 0)
    assert m.allocate("s", 0) is None  # no slot left even for an empty prompt


def test_grow_takes_blocks_only_where_they_are_free():
    m = HybridCacheManager(tiny_spec(), num_blocks=4, num_slots=2)
    table = m.allocate("a", 3).block_table
    assert m.grow("a", 4)
    assert len(table) == 1 and m.get("a").num_tokens == 4
    first = list(table)
    assert m.grow("a", 13)
    assert len(table) == 4 and table[:1] == first and m.num_free_blocks == 0
    assert not m.grow("a", 17)                 # 1 more block, none free: nothing changes
    assert len(table) == 4 and m.get("a").num_tokens == 13
    assert m.grow("a", 16)
    with pytest.raises(ValueError, match="would shrink it"):
        m.grow("a", 12)


def test_commit_after_a_verify_moves_length_and_slot_together():
    m = HybridCacheManager(tiny_spec(), num_blocks=4, num_slots=4)
    cache = m.allocate("a", 9, num_draft_slots=3)
    slot, drafts, table = cache.slot, list(cache.draft_slots), list(cache.block_table)
    # a verify of 4 tokens writes the state after token j to write slot j: committed, then drafts
    assert cache.write_slots(4) == [slot, *drafts] and cache.write_slots(1) == [slot]
    assert [cache.write_slot(j) for j in range(4)] == [slot, *drafts]
    m.commit("a", 5)
    assert cache.num_committed_tokens == 5
    m.commit("a", 7, accepted=2)   # last token + 2 drafts: the state after draft 2
    assert cache.slot == drafts[1] and cache.draft_slots == [drafts[0], slot, drafts[2]]
    assert cache.num_committed_tokens == 7 and cache.block_table == table    # no block given back
    m.commit("a", 8, accepted=0)
    assert cache.slot == drafts[1] and cache.num_committed_tokens == 8
    # Refused calls change nothing: too many drafts, past the reservation, backwards.
    for bad in [lambda: m.commit("a", 9, accepted=4), lambda: m.commit("a", 10, accepted=1),
                lambda: m.commit("a", 7), lambda: m.commit("a", 9, accepted=-1)]:
        with pytest.raises((IndexError, ValueError)):
            bad()
        assert cache.slot == drafts[1] and cache.num_committed_tokens == 8
    m.free("a")
    assert m.num_free_slots == 4


def test_usage_reports_both_kinds_in_bytes():
    spec = tiny_spec()
    m = HybridCacheManager(spec, num_blocks=6, num_slots=3)
    m.allocate("a", 5, num_draft_slots=1)
    u = m.usage()
    assert u["num_requests"] == 1
    assert (u["blocks_total"], u["blocks_used"], u["blocks_free"]) == (6, 2, 4)
    assert (u["slots_total"], u["slots_used"], u["slots_free"]) == (3, 2, 1)
    assert u["kv_bytes_total"] == 6 * spec.bytes_per_block and u["kv_bytes_used"] == 2 * spec.bytes_per_block
    assert u["state_bytes_total"] == 4 * spec.bytes_per_slot and u["state_bytes_used"] == 2 * spec.bytes_per_slot


# -- budget -------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(
    budget=st.integers(0, 200_000),
    max_num_seqs=st.integers(1, 8),
    draft_slots=st.integers(0, 3),
    state_dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_from_budget_fills_the_budget_exactly(budget, max_num_seqs, draft_slots, state_dtype):
    spec = tiny_spec(state_dtype=state_dtype)
    slot_bytes = (max_num_seqs * (1 + draft_slots) + 1) * spec.bytes_per_slot     # + pad_slot
    if budget < slot_bytes + max_num_seqs * spec.bytes_per_block:
        with pytest.raises(ValueError, match="too small"):
            HybridCacheManager.from_budget(spec, budget, max_num_seqs, draft_slots)
        return
    m = HybridCacheManager.from_budget(spec, budget, max_num_seqs, draft_slots)
    assert m.num_slots == max_num_seqs * (1 + draft_slots)
    assert m.num_blocks >= max_num_seqs
    assert tensor_bytes(m) <= budget
    assert tensor_bytes(m) + spec.bytes_per_block > budget  # one more block would not fit


def test_from_budget_error_names_the_shortfall():
    spec = tiny_spec()
    need = (4 * 2 + 1) * spec.bytes_per_slot + 4 * spec.bytes_per_block
    with pytest.raises(ValueError, match=f"8 state slots.*need at least {need} bytes"):
        HybridCacheManager.from_budget(spec, need - 1, max_num_seqs=4, draft_slots_per_seq=1)
    assert HybridCacheManager.from_budget(spec, need, max_num_seqs=4, draft_slots_per_seq=1).num_blocks == 4


@settings(max_examples=200, deadline=None)
@given(
    budget=st.integers(0, 300_000),
    max_num_seqs=st.integers(1, 6),
    draft_slots=st.integers(0, 2),
    wanted=st.integers(0, 16),
    hidden_size=st.sampled_from([0, 8]),
)
def test_from_budget_gives_checkpoints_what_the_requests_leave(budget, max_num_seqs, draft_slots, wanted,
                                                               hidden_size):
    """Checkpoints never refuse a budget the requests fit in: as many as fit beside the requests'
    slots and at least one KV block per sequence and per checkpoint, up to the number asked."""
    spec = tiny_spec(hidden_size=hidden_size)
    slot_bytes = (max_num_seqs * (1 + draft_slots) + 1) * spec.bytes_per_slot     # + pad_slot
    per_checkpoint, per_block = CheckpointPool.bytes_per_checkpoint(spec), spec.bytes_per_block
    if budget < slot_bytes + max_num_seqs * per_block:
        with pytest.raises(ValueError, match="too small"):
            HybridCacheManager.from_budget(spec, budget, max_num_seqs, draft_slots, num_checkpoints=wanted)
        return
    m = HybridCacheManager.from_budget(spec, budget, max_num_seqs, draft_slots, num_checkpoints=wanted)
    kept, blocks = m.prefix_store.checkpoints.size, m.num_blocks
    assert kept <= wanted and blocks >= max(max_num_seqs, kept)
    pools = m.pools
    checkpoint_tensors = [pools.checkpoint_conv_layers, pools.checkpoint_recurrent_layers, pools.checkpoint_hidden]
    used = tensor_bytes(m) + sum(t.numel() * t.element_size() for t in checkpoint_tensors)
    assert used == slot_bytes + kept * per_checkpoint + blocks * per_block <= budget
    assert used + per_block > budget                            # the KV blocks take the rest
    if kept < wanted:                                           # one more would break a rule
        assert (budget - slot_bytes - (kept + 1) * per_checkpoint) // per_block < max(max_num_seqs, kept + 1)


# -- random op sequences --------------------------------------------------------------------

REQUEST_IDS = ["a", "b", "c", ("d", 1), 5]


class CacheMachine(RuleBasedStateMachine):
    """Random allocate/grow/promote/free over a few requests; a small pool so that
    refusals are common. A plain dict model tracks what each request should hold."""

    def __init__(self):
        super().__init__()
        self.m = HybridCacheManager(tiny_spec(), num_blocks=10, num_slots=6)
        self.tokens: dict = {}  # request id -> num_tokens it should hold

    def refused(self, exc_type, call) -> None:
        before = snapshot(self.m, REQUEST_IDS)
        with pytest.raises(exc_type):
            call()
        assert snapshot(self.m, REQUEST_IDS) == before

    @rule(rid=st.sampled_from(REQUEST_IDS), num_tokens=st.integers(0, 30), drafts=st.integers(0, 3))
    def allocate(self, rid, num_tokens, drafts):
        if rid in self.m:
            self.refused(ValueError, lambda: self.m.allocate(rid, num_tokens, drafts))
            return
        fits = (self.m.spec.blocks_for(num_tokens) <= self.m.num_free_blocks
                and 1 + drafts <= self.m.num_free_slots)
        before = snapshot(self.m, REQUEST_IDS)
        cache = self.m.allocate(rid, num_tokens, drafts)
        if fits:
            assert len(cache.draft_slots) == drafts
            self.tokens[rid] = num_tokens
        else:
            assert cache is None and snapshot(self.m, REQUEST_IDS) == before   # refused: nothing changed

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(0, 12))
    def grow(self, data, extra):
        """The scheduler's verb: grow where the blocks it needs are free, else False and no change."""
        rid = data.draw(st.sampled_from(sorted(self.tokens, key=repr)))
        new = self.tokens[rid] + extra
        prefix = list(self.m.get(rid).block_table)
        fits = self.m.spec.blocks_for(new) - len(prefix) <= self.m.num_free_blocks
        before = snapshot(self.m, REQUEST_IDS)
        assert self.m.grow(rid, new) == fits
        if fits:
            assert self.m.get(rid).block_table[: len(prefix)] == prefix
            assert len(self.m.get(rid).block_table) == self.m.spec.blocks_for(new)
            self.tokens[rid] = new
        else:
            assert snapshot(self.m, REQUEST_IDS) == before

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def commit(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens, key=repr)))
        cache = self.m.get(rid)
        accepted = data.draw(st.integers(0, len(cache.draft_slots) + 1))   # one past the end: refused
        length = data.draw(st.integers(0, self.tokens[rid] + 1))           # past the reservation: refused
        if accepted > len(cache.draft_slots) or not cache.num_committed_tokens <= length <= self.tokens[rid]:
            error = ValueError if not cache.num_committed_tokens <= length <= self.tokens[rid] else IndexError
            self.refused(error, lambda: self.m.commit(rid, length, accepted))
            return
        held = {cache.slot, *cache.draft_slots}
        new_slot = cache.draft_slots[accepted - 1] if accepted else cache.slot
        self.m.commit(rid, length, accepted)
        assert cache.slot == new_slot and {cache.slot, *cache.draft_slots} == held
        assert cache.num_committed_tokens == length

    @rule(rid=st.sampled_from(REQUEST_IDS))
    def free(self, rid):
        if rid in self.tokens:
            self.m.free(rid)
            del self.tokens[rid]
        else:
            self.refused(KeyError, lambda: self.m.free(rid))

    @invariant()
    def each_block_and_slot_has_one_owner(self):
        blocks, slots = [], []
        for rid, num_tokens in self.tokens.items():
            cache = self.m.get(rid)
            assert cache.num_tokens == num_tokens
            assert len(cache.block_table) == self.m.spec.blocks_for(num_tokens)
            blocks += cache.block_table
            slots += [cache.slot, *cache.draft_slots]
        assert len(set(blocks)) == len(blocks) and len(set(slots)) == len(slots)
        assert len(blocks) + self.m.num_free_blocks == self.m.num_blocks
        assert len(slots) + self.m.num_free_slots == self.m.num_slots
        usage = self.m.usage()
        assert (usage["blocks_used"], usage["slots_used"]) == (len(blocks), len(slots))
        # What is free is exactly what nobody owns: take it all, compare, give it back.
        for pool, owned, total in [(self.m._blocks, blocks, self.m.num_blocks), (self.m._slots, slots, self.m.num_slots)]:
            spare = pool.allocate(pool.num_free)
            assert sorted(spare + owned) == list(range(total))
            pool.free(spare)

    def teardown(self):
        for rid in list(self.tokens):
            self.m.free(rid)
        assert (self.m.num_free_blocks, self.m.num_free_slots) == (self.m.num_blocks, self.m.num_slots)
        assert self.m.usage()["num_requests"] == 0


CacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestCacheMachine = CacheMachine.TestCase


def test_pad_slot_is_never_handed_out():
    m = HybridCacheManager(tiny_spec(), num_blocks=4, num_slots=3)
    assert m.pools.pad_slot == 3 and m.pools.conv_states[0].shape[0] == 4
    held = [m.allocate("a", 1, num_draft_slots=1), m.allocate("b", 1)]
    slots = {c.slot for c in held} | {s for c in held for s in c.draft_slots}
    assert slots == {0, 1, 2} and m.num_free_slots == 0
    assert m.allocate("c", 1) is None
