"""Block pool and KV cache manager: ref counts, LRU free queue, prefix index, allocation limits."""

from __future__ import annotations

import pytest
from kvfleet_runtime.engine.block_pool import BlockPool
from kvfleet_runtime.engine.kv_cache_manager import KVCacheManager
from kvfleet_runtime.request import Request
from kvfleet_runtime.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def test_null_block_is_never_handed_out():
    pool = BlockPool(4, enable_caching=True)
    ids = [b.block_id for b in pool.get_new_blocks(3)]
    assert 0 not in ids and sorted(ids) == [1, 2, 3]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)


def test_freed_blocks_are_reused_in_lru_order():
    pool = BlockPool(5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])   # c freed first: least recently used
    pool.free_blocks([d])
    assert [blk.block_id for blk in pool.get_new_blocks(3)] == [c.block_id, a.block_id, d.block_id]


def test_touch_takes_a_cached_block_back_from_the_free_queue():
    pool = BlockPool(4, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 1234)
    pool.free_blocks([a])
    assert a.ref_cnt == 0 and pool.get_cached_block(1234) is a
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2


def test_eviction_drops_the_hash():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 99)
    pool.free_blocks([a])
    (again,) = pool.get_new_blocks(1)       # the only block: evicted and reused
    assert again is a and a.block_hash is None and pool.get_cached_block(99) is None


def test_double_free_raises():
    pool = BlockPool(3, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a])


def test_prefix_hit_skips_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    first = _req("a", list(range(10, 22)))                   # 12 tokens = 3 full blocks
    assert kv.get_computed_blocks(first) == ([], 0)
    assert kv.allocate_slots(first, 12) is not None
    second = _req("b", list(range(10, 22)))
    blocks, num_computed = kv.get_computed_blocks(second)
    # the last token is always recomputed, so only 2 of the 3 full blocks are hits
    assert num_computed == 8 and len(blocks) == 2
    assert [b.block_id for b in blocks] == kv.get_block_ids("a")[:2]
    kv.allocate_slots(second, 4, blocks)
    assert all(b.ref_cnt == 2 for b in blocks)
    kv.free(first)
    kv.free(second)
    assert kv.block_pool.get_num_free_blocks() == 19


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=False)
    big = _req("big", list(range(13)))
    assert kv.allocate_slots(big, 13) is None
    assert kv.block_pool.get_num_free_blocks() == 3 and "big" not in kv.req_to_blocks


def test_different_prefix_does_not_hit():
    kv = KVCacheManager(num_blocks=20, block_size=4, enable_caching=True)
    kv.allocate_slots(_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    other = _req("b", [1, 2, 3, 5, 5, 6, 7, 8, 9])          # differs in block 0
    assert kv.get_computed_blocks(other) == ([], 0)
