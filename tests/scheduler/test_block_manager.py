"""Paged blocks: ref counts, prefix-cache hits, LRU eviction (leaves first), no leaks."""
import pytest

from guided.scheduler.block_manager import BlockManager


def test_allocate_free_roundtrip_and_double_free():
    bm = BlockManager(8, 4)
    ids = bm.allocate(3)
    assert bm.num_free_blocks == 5
    bm.free(ids)
    assert bm.num_free_blocks == 8
    with pytest.raises(RuntimeError):
        bm.free(ids)
    with pytest.raises(MemoryError):
        bm.allocate(9)


def test_prefix_hit_shares_blocks_and_checks_tokens():
    bm = BlockManager(8, 4)
    tokens = list(range(10))
    ids = bm.allocate(3)
    bm.register_full_blocks(ids, tokens, 0, 2)  # two full blocks cached
    assert bm.find_cached_prefix(tokens, 10) == ids[:2]
    assert bm.find_cached_prefix(tokens, 7) == ids[:1]  # at most 7 tokens: one block
    assert bm.find_cached_prefix([0, 1, 2, 99] + tokens[4:], 10) == []
    bm.share(ids[:2])
    assert bm.blocks[ids[0]].ref_count == 2
    bm.free(ids)
    bm.free(ids[:2])
    assert bm.num_free_blocks == 8
    # freed but still cached: a later request hits them
    assert bm.find_cached_prefix(tokens, 10) == ids[:2]


def test_eviction_reuses_uncached_first_then_leaves_before_parents():
    bm = BlockManager(4, 2)
    ids = bm.allocate(3)
    bm.register_full_blocks(ids, [1, 2, 3, 4, 5, 6], 0, 3)
    bm.free(ids)
    # the never-used block goes first
    first = bm.allocate(1)
    assert first[0] not in ids
    # then the leaf of the cached chain, before its parents
    second = bm.allocate(1)
    assert second == [ids[2]]
    assert bm.find_cached_prefix([1, 2, 3, 4, 5, 6], 6) == ids[:2]


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    ids = bm.allocate(2)
    bm.register_full_blocks(ids, [1, 2, 3, 4], 0, 2)
    assert bm.find_cached_prefix([1, 2, 3, 4], 4) == []
