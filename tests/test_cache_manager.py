"""Unit tests for the pure-integer cache bookkeeping (lamina/engine/cache_manager.py)."""

from __future__ import annotations

import random

import pytest

from lamina.engine.cache_manager import BlockAllocator, CacheManager, SlotAllocator


def owned_blocks(cache: CacheManager) -> dict[int, str]:
    """block id -> owning request id; asserts that no block has two owners."""
    owner: dict[int, str] = {}
    for rid, table in cache._tables.items():
        for b in table:
            assert b not in owner, f"block {b} owned by both {owner[b]} and {rid}"
            owner[b] = rid
    return owner


def check_invariants(cache: CacheManager) -> None:
    owner = owned_blocks(cache)
    free = list(cache.blocks._free)
    assert len(set(free)) == len(free), "a block is free twice"
    assert not set(free) & set(owner), "a block is both free and owned"
    assert len(free) + len(owner) == cache.num_blocks
    assert set(free) | set(owner) == set(range(cache.num_blocks))
    slots = list(cache._slot_of.values())
    free_slots = list(cache.slots._free)
    assert len(set(slots)) == len(slots), "a state slot has two owners"
    assert len(set(free_slots)) == len(free_slots)
    assert not set(slots) & set(free_slots)
    assert set(slots) | set(free_slots) == set(range(cache.slots.num_slots))
    assert set(cache._tables) == set(cache._slot_of)
    assert cache.usage() == pytest.approx(len(owner) / cache.num_blocks)


# ---- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks,block_size,num_slots", [(0, 16, 1), (-1, 16, 1), (4, 0, 1), (4, -2, 1), (4, 16, 0), (4, 16, -1)])
def test_constructor_rejects_non_positive_sizes(num_blocks, block_size, num_slots):
    with pytest.raises(ValueError):
        CacheManager(num_blocks, block_size, num_slots)


def test_fresh_cache_is_empty():
    cache = CacheManager(num_blocks=8, block_size=4, num_state_slots=3)
    assert cache.num_blocks == 8
    assert cache.blocks.num_free == 8
    assert cache.slots.num_free == 3
    assert cache.usage() == 0.0
    assert not cache.has("a")
    with pytest.raises(KeyError):
        cache.block_table("a")
    with pytest.raises(KeyError):
        cache.state_slot("a")
    check_invariants(cache)


@pytest.mark.parametrize("tokens,blocks", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (100, 25)])
def test_blocks_needed_rounds_up(tokens, blocks):
    assert CacheManager(num_blocks=1, block_size=4, num_state_slots=1).blocks_needed(tokens) == blocks


# ---- allocation -----------------------------------------------------------------------------


def test_allocate_new_request_takes_blocks_and_a_slot():
    cache = CacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert cache.allocate("a", 6)
    assert cache.has("a")
    assert len(cache.block_table("a")) == 2
    assert cache.state_slot("a") in (0, 1)
    assert cache.blocks.num_free == 6
    assert cache.slots.num_free == 1
    assert cache.usage() == pytest.approx(2 / 8)
    check_invariants(cache)


def test_allocate_zero_tokens_takes_only_a_slot():
    cache = CacheManager(num_blocks=4, block_size=4, num_state_slots=2)
    assert cache.allocate("a", 0)
    assert cache.has("a")
    assert cache.block_table("a") == []
    assert cache.blocks.num_free == 4
    assert cache.slots.num_free == 1
    check_invariants(cache)
    cache.free("a")
    assert not cache.has("a")
    assert cache.slots.num_free == 2
    check_invariants(cache)


def test_block_table_grows_one_block_at_a_time_with_decode():
    bs = 4
    cache = CacheManager(num_blocks=16, block_size=bs, num_state_slots=1)
    assert cache.allocate("a", 5)  # a 5-token prompt
    slot = cache.state_slot("a")
    prev = list(cache.block_table("a"))
    assert len(prev) == 2
    for total in range(6, 40):  # one decode token per step
        assert cache.allocate("a", total)
        table = cache.block_table("a")
        assert len(table) == -(-total // bs)
        assert table[: len(prev)] == prev, "existing blocks must never move"
        assert len(table) - len(prev) == (1 if (total - 1) % bs == 0 else 0)
        assert cache.state_slot("a") == slot, "a request keeps its state slot"
        prev = list(table)
        check_invariants(cache)
    assert cache.usage() == pytest.approx(10 / 16)


def test_allocating_fewer_tokens_than_covered_changes_nothing():
    cache = CacheManager(num_blocks=8, block_size=4, num_state_slots=1)
    assert cache.allocate("a", 12)
    table = list(cache.block_table("a"))
    assert cache.allocate("a", 3)
    assert cache.allocate("a", 12)
    assert cache.allocate("a", 0)
    assert cache.block_table("a") == table
    assert cache.blocks.num_free == 5
    check_invariants(cache)


def test_exact_fit_then_one_token_more_fails():
    cache = CacheManager(num_blocks=4, block_size=4, num_state_slots=1)
    assert cache.allocate("a", 16)
    assert cache.blocks.num_free == 0
    assert cache.usage() == 1.0
    assert not cache.allocate("a", 17)
    assert len(cache.block_table("a")) == 4
    assert cache.usage() == 1.0
    check_invariants(cache)


def test_failed_allocation_of_new_request_is_atomic_when_blocks_short():
    cache = CacheManager(num_blocks=4, block_size=4, num_state_slots=4)
    assert cache.allocate("a", 10)  # 3 blocks
    free_blocks = list(cache.blocks._free)
    free_slots = list(cache.slots._free)
    assert not cache.allocate("b", 5)  # needs 2 blocks, 1 free
    assert not cache.has("b")
    assert "b" not in cache._tables
    assert list(cache.blocks._free) == free_blocks
    assert list(cache.slots._free) == free_slots, "no state slot may leak on a failed allocation"
    with pytest.raises(KeyError):
        cache.block_table("b")
    check_invariants(cache)
    # what fits still fits
    assert cache.allocate("b", 4)
    check_invariants(cache)


def test_failed_growth_of_existing_request_is_atomic():
    cache = CacheManager(num_blocks=4, block_size=2, num_state_slots=2)
    assert cache.allocate("a", 4)  # 2 blocks
    assert cache.allocate("b", 3)  # 2 blocks
    table_a = list(cache.block_table("a"))
    slot_a = cache.state_slot("a")
    assert not cache.allocate("a", 5)
    assert cache.block_table("a") == table_a
    assert cache.state_slot("a") == slot_a
    assert cache.blocks.num_free == 0
    check_invariants(cache)
    cache.free("b")
    assert cache.allocate("a", 5)
    assert cache.block_table("a")[:2] == table_a
    check_invariants(cache)


def test_failed_allocation_is_atomic_when_state_slots_short():
    cache = CacheManager(num_blocks=100, block_size=4, num_state_slots=2)
    assert cache.allocate("a", 4)
    assert cache.allocate("b", 4)
    free_blocks = list(cache.blocks._free)
    assert not cache.allocate("c", 4)  # plenty of blocks, but no slot
    assert not cache.has("c")
    assert list(cache.blocks._free) == free_blocks, "no block may leak on a failed allocation"
    assert cache.slots.num_free == 0
    check_invariants(cache)
    # existing requests need no new slot: they keep growing
    assert cache.allocate("a", 40)
    check_invariants(cache)


def test_state_slot_is_reused_after_free():
    cache = CacheManager(num_blocks=8, block_size=4, num_state_slots=2)
    assert cache.allocate("a", 1)
    assert cache.allocate("b", 1)
    slot_a = cache.state_slot("a")
    assert {slot_a, cache.state_slot("b")} == {0, 1}
    assert not cache.allocate("c", 1)
    cache.free("a")
    assert cache.allocate("c", 1)
    assert cache.state_slot("c") == slot_a
    check_invariants(cache)


def test_free_returns_everything_and_blocks_are_reused():
    cache = CacheManager(num_blocks=6, block_size=4, num_state_slots=3)
    assert cache.allocate("a", 8)
    assert cache.allocate("b", 8)
    assert cache.allocate("c", 8)
    assert cache.usage() == 1.0
    blocks_b = set(cache.block_table("b"))
    cache.free("b")
    assert not cache.has("b")
    assert cache.blocks.num_free == 2
    assert cache.slots.num_free == 1
    assert cache.usage() == pytest.approx(4 / 6)
    check_invariants(cache)
    assert cache.allocate("d", 5)
    assert set(cache.block_table("d")) == blocks_b
    check_invariants(cache)
    for rid in ("a", "c", "d"):
        cache.free(rid)
    assert cache.usage() == 0.0
    assert cache.blocks.num_free == 6 and cache.slots.num_free == 3
    check_invariants(cache)


def test_free_unknown_or_twice_is_a_no_op():
    cache = CacheManager(num_blocks=4, block_size=4, num_state_slots=2)
    cache.free("nobody")
    assert cache.allocate("a", 8)
    cache.free("a")
    cache.free("a")  # a second free must not put the blocks/slot in the pool twice
    assert cache.blocks.num_free == 4
    assert cache.slots.num_free == 2
    check_invariants(cache)


def test_usage_fraction():
    cache = CacheManager(num_blocks=10, block_size=1, num_state_slots=10)
    for i in range(10):
        assert cache.allocate(str(i), 1)
        assert cache.usage() == pytest.approx((i + 1) / 10)
    for i in range(10):
        cache.free(str(i))
        assert cache.usage() == pytest.approx((9 - i) / 10)


def test_raw_allocators():
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        SlotAllocator(0)
    blocks = BlockAllocator(3)
    got = blocks.allocate(2)
    assert len(set(got)) == 2 and blocks.num_free == 1
    assert blocks.allocate(0) == []
    with pytest.raises(RuntimeError):
        blocks.allocate(2)
    assert blocks.num_free == 1
    blocks.free(got)
    assert blocks.num_free == 3
    slots = SlotAllocator(1)
    s = slots.allocate()
    with pytest.raises(RuntimeError):
        slots.allocate()
    slots.free(s)
    assert slots.allocate() == s


# ---- randomized ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_random_allocate_free_keeps_accounting_exact(seed):
    rng = random.Random(seed)
    num_blocks = rng.randint(1, 40)
    bs = rng.randint(1, 8)
    num_slots = rng.randint(1, 6)
    cache = CacheManager(num_blocks, bs, num_slots)
    covered: dict[str, int] = {}  # request -> tokens its table must cover
    tables: dict[str, list[int]] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.65:
            rid = rng.choice(list(covered) + [f"r{step}"]) if covered and rng.random() < 0.7 else f"r{step}"
            want = covered.get(rid, 0) + rng.randint(0, 3 * bs)
            before_free = list(cache.blocks._free)
            before_slots = list(cache.slots._free)
            expected_ok = (
                (rid in covered or cache.slots.num_free > 0)
                and cache.blocks_needed(want) - len(tables.get(rid, [])) <= cache.blocks.num_free
            )
            ok = cache.allocate(rid, want)
            assert ok == expected_ok
            if ok:
                covered[rid] = max(covered.get(rid, 0), want)
                table = cache.block_table(rid)
                assert table[: len(tables.get(rid, []))] == tables.get(rid, [])
                assert len(table) == max(len(tables.get(rid, [])), cache.blocks_needed(want))
                tables[rid] = list(table)
            else:
                assert list(cache.blocks._free) == before_free
                assert list(cache.slots._free) == before_slots
                assert cache.has(rid) == (rid in covered)
        elif covered:
            rid = rng.choice(list(covered))
            cache.free(rid)
            del covered[rid], tables[rid]
        check_invariants(cache)
        for rid, n in covered.items():
            assert len(cache.block_table(rid)) * bs >= n
