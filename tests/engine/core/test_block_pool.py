from __future__ import annotations

import pytest
from core_testing import make_request

from engine.core.block_pool import BLOCK_CACHED, BLOCK_FREE, BLOCK_USED, BlockPool
from engine.core.kv_cache_utils import extend_block_hashes


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def hashed_request(num_tokens: int, block_size: int = 4, rid: str = "r"):
    req = make_request(rid, list(range(100, 100 + num_tokens)))
    extend_block_hashes(req, block_size)
    return req


def test_null_block_is_reserved():
    pool = BlockPool(6)
    assert pool.null_block.block_id == 0
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 5
    assert [b.block_id for b in pool.get_new_blocks(5)] == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="cannot allocate 1 blocks, only 0 are free"):
        pool.get_new_blocks(1)


def test_too_few_blocks_is_rejected():
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1)


def test_ref_counts_and_usage():
    pool = BlockPool(5)
    assert pool.usage == 0.0
    a, b = pool.get_new_blocks(2)
    assert (a.ref_cnt, b.ref_cnt) == (1, 1)
    assert pool.usage == 0.5
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and a.block_id not in free_ids(pool)
    pool.free_blocks([b, a])
    assert pool.usage == 0.0 and pool.num_free_blocks == 4


def test_eviction_order_unhashed_first_then_cached_lru_tail_first():
    """Freed blocks without a hash go to the head (reused first); cached blocks go to the
    tail in the order freed, and a request frees in reverse, so a chain's tail goes first."""
    pool = BlockPool(9)
    req = hashed_request(12)  # three full blocks of 4
    blocks = pool.get_new_blocks(4)  # ids 1..4: three full + one partial
    pool.cache_full_blocks(req, blocks, 0, 3)
    assert [b.block_hash is not None for b in blocks] == [True, True, True, False]
    assert free_ids(pool) == [5, 6, 7, 8]
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 8, 3, 2, 1]
    # Reuse order: the partial block, the never-used ones, then the chain from its tail.
    got = [pool.get_new_blocks(1)[0].block_id for _ in range(8)]
    assert got == [4, 5, 6, 7, 8, 3, 2, 1]


def test_lazy_eviction_drops_hash_only_when_reused():
    pool = BlockPool(4)
    req = hashed_request(8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    # Free but still cached: a hit until reused.
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]
    assert pool.get_cached_block(req.block_hashes[1]) is blocks[1]
    assert free_ids(pool) == [3, 2, 1]
    [fresh] = pool.get_new_blocks(1)
    assert fresh.block_id == 3
    [evicted] = pool.get_new_blocks(1)  # the chain's tail goes first
    assert evicted is blocks[1] and evicted.block_hash is None
    assert pool.get_cached_block(req.block_hashes[1]) is None
    assert pool.get_cached_block(req.block_hashes[0]) is blocks[0]


def test_touch_takes_a_free_cached_block_out_of_the_queue():
    pool = BlockPool(5)
    req = hashed_request(4)
    [block] = pool.get_new_blocks(1)
    pool.cache_full_blocks(req, [block], 0, 1)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and block.block_id in free_ids(pool)
    pool.touch([pool.get_cached_block(req.block_hashes[0])])
    assert block.ref_cnt == 1
    assert free_ids(pool) == [2, 3, 4]
    assert pool.num_free_blocks == 3


def test_duplicate_content_is_not_cached_twice():
    pool = BlockPool(5)
    r1, r2 = hashed_request(4, rid="a"), hashed_request(4, rid="b")
    [b1], [b2] = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(r1, [b1], 0, 1)
    pool.cache_full_blocks(r2, [b2], 0, 1)
    assert pool.get_cached_block(r1.block_hashes[0]) is b1
    assert b2.block_hash is None
    pool.free_blocks([b1])
    pool.free_blocks([b2])
    assert free_ids(pool)[0] == b2.block_id  # the duplicate is reused first


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    req = hashed_request(8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_only_when_all_blocks_free():
    pool = BlockPool(4)
    req = hashed_request(8)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(req, blocks, 0, 2)
    assert pool.reset_prefix_cache() is False
    assert len(pool.cached_block_hash_to_block) == 2
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in pool.blocks)


def test_block_states():
    pool = BlockPool(6)
    req = hashed_request(8)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, 0, 2)
    pool.free_blocks([blocks[1]])  # cached and free
    assert list(pool.block_states()) == [
        BLOCK_USED,  # the null block
        BLOCK_USED,
        BLOCK_CACHED,
        BLOCK_USED,
        BLOCK_FREE,
        BLOCK_FREE,
    ]
