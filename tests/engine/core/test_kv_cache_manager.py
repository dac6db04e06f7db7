"""KVCacheManager, vLLM tests/v1/core/test_prefix_caching.py style: exact block ids,
exact eviction order, exact hit lengths, with 16-token blocks."""

from __future__ import annotations

import pytest
from core_testing import make_request

from engine.core.kv_cache_manager import KVCacheManager, NoFreeBlocksError
from engine.core.kv_cache_utils import hash_block_tokens
from engine.request import Request

BS = 16


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def compute(manager: KVCacheManager, req: Request, num_new: int, hit=None) -> list[int]:
    """What the scheduler does for one step: allocate, advance, (forward), cache."""
    new = manager.allocate_slots(req, num_new, hit)
    assert new is not None
    req.num_computed_tokens += len(hit or []) * BS + num_new
    manager.cache_blocks(req)
    return [b.block_id for b in new]


def admit(manager: KVCacheManager, req: Request) -> tuple[list[int], int, list[int]]:
    hit, num_hit = manager.get_computed_blocks(req)
    new_ids = compute(manager, req, req.num_tokens - num_hit, hit)
    return [b.block_id for b in hit], num_hit, new_ids


def test_prefill_prefix_hits_and_eviction_order():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    common = [i for i in range(3) for _ in range(BS)]  # three full blocks

    # Full miss: 3 full blocks + 7 tokens.
    req0 = make_request("0", common + [3] * 7)
    hit_ids, num_hit, new_ids = admit(manager, req0)
    assert (hit_ids, num_hit, new_ids) == ([], 0, [1, 2, 3, 4])
    assert len(req0.block_hashes) == 3
    parent = None
    for block_id in (1, 2, 3):
        block = manager.block_pool.blocks[block_id]
        parent = hash_block_tokens(parent, common[(block_id - 1) * BS : block_id * BS])
        assert block.block_hash == parent and block.ref_cnt == 1
    assert manager.block_pool.blocks[4].block_hash is None  # partial: never cached

    # Hit on the common prefix while its blocks are in use.
    req1 = make_request("1", common + [3] * 5)
    assert admit(manager, req1) == ([1, 2, 3], 48, [5])
    assert [manager.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert manager.num_free_blocks == 5

    manager.free(req0)
    manager.free(req1)
    assert manager.num_free_blocks == 10
    # Unhashed blocks at the head, most recently freed first; the cached chain at the tail,
    # its last block first.
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    # Hit on the common prefix while its blocks are free (and still cached).
    req2 = make_request("2", common + [3] * 6)
    assert admit(manager, req2) == ([1, 2, 3], 48, [5])
    assert manager.num_free_blocks == 6
    assert free_ids(manager) == [4, 6, 7, 8, 9, 10]
    manager.free(req2)

    # A miss of 10 blocks evicts in order: unhashed, never used, then the chain tail first.
    req3 = make_request("3", [99] * (BS * 10))
    assert admit(manager, req3) == ([], 0, [5, 4, 6, 7, 8, 9, 10, 3, 2, 1])
    assert manager.num_free_blocks == 0
    assert manager.block_pool.cached_block_hash_to_block.keys() == set(req3.block_hashes)


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = KVCacheManager(num_blocks=40, block_size=BS)
    prompt = list(range(11 * BS))  # exactly 11 full blocks
    req0 = make_request("0", prompt)
    assert admit(manager, req0) == ([], 0, list(range(1, 12)))
    assert len(manager.block_pool.cached_block_hash_to_block) == 11

    # The same prompt: a full hit would leave nothing to compute, so the last block is dropped.
    same = make_request("same", prompt)
    hit, num_hit = manager.get_computed_blocks(same)
    assert [b.block_id for b in hit] == list(range(1, 11)) and num_hit == 10 * BS

    # 11 full blocks + 3: all 11 hit, the 3 tokens are computed.
    longer = make_request("longer", prompt + [7, 8, 9])
    assert admit(manager, longer) == (list(range(1, 12)), 176, [12])

    # One token more than 10 blocks: the 11th block of the chain is not full in this request.
    shorter = make_request("shorter", prompt[: 10 * BS + 1])
    hit, num_hit = manager.get_computed_blocks(shorter)
    assert num_hit == 10 * BS

    # A prompt that diverges in block 5 hits blocks 0..4 only.
    diverge = make_request("d", prompt[: 5 * BS] + [1000] + prompt[5 * BS + 1 :])
    hit, num_hit = manager.get_computed_blocks(diverge)
    assert [b.block_id for b in hit] == [1, 2, 3, 4, 5] and num_hit == 5 * BS


def test_decode_caches_blocks_as_they_fill():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", list(range(BS + 14)))  # 30 tokens
    admit(manager, req)
    assert manager.get_block_ids("r") == [1, 2]
    assert len(manager.block_pool.cached_block_hash_to_block) == 1
    req.append_output_token(500)
    assert compute(manager, req, 1) == []  # 31 tokens computed: block 2 not full yet
    assert manager.block_pool.blocks[2].block_hash is None
    req.append_output_token(501)
    assert compute(manager, req, 1) == []  # 32 computed: block 2 is full, and cached
    assert manager.block_pool.blocks[2].block_hash == req.block_hashes[1]
    req.append_output_token(502)
    assert compute(manager, req, 1) == [3]
    other = make_request("o", req.all_token_ids[:32] + [1])
    assert manager.get_computed_blocks(other)[1] == 32


def test_block_ids_list_is_shared_and_appended_in_place():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("r", list(range(20)))
    compute(manager, req, 20)
    table = manager.get_block_ids("r")
    assert table == [1, 2]
    for t in range(13):
        req.append_output_token(t)
        compute(manager, req, 1)
    assert manager.get_block_ids("r") is table and table == [1, 2, 3]
    manager.free(req)
    assert manager.get_block_ids("r") == []


def test_allocate_slots_returns_none_and_changes_nothing_when_full():
    manager = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(40)))
    compute(manager, a, 40)
    b = make_request("b", list(range(100, 120)))
    assert manager.allocate_slots(b, 20) is None
    assert manager.get_block_ids("b") == [] and manager.num_free_blocks == 0
    assert "b" not in manager.req_to_blocks


def test_free_hit_blocks_do_not_count_as_free_space():
    manager = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(33)))
    compute(manager, a, 33)
    manager.free(a)  # blocks 1, 2 cached and free; 3 free
    b = make_request("b", list(range(32)) + list(range(500, 532)))  # 4 blocks: too many
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 32
    # 2 hit blocks + 2 new > 3 usable: touching the free hits would leave only 1 free.
    assert manager.allocate_slots(b, 32, hit) is None
    assert manager.num_free_blocks == 3 and all(blk.ref_cnt == 0 for blk in hit)
    c = make_request("c", list(range(32)) + [7] * 10)
    hit, _ = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in manager.allocate_slots(c, 10, hit)] == [3]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request("p", list(range(2 * BS + 5)))  # 2 full blocks + 5
    compute(manager, parent, parent.num_tokens)
    child = make_request("p#1", parent.prompt_token_ids)
    copy = manager.fork(parent, child)
    assert copy == (3, 4)
    assert manager.get_block_ids("p#1") == [1, 2, 4]
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert child.block_hashes == parent.block_hashes[:2]
    manager.free(parent)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    manager.free(child)
    assert manager.num_free_blocks == 9


def test_fork_at_a_block_boundary_needs_no_copy():
    manager = KVCacheManager(num_blocks=10, block_size=BS)
    parent = make_request("p", list(range(2 * BS)))
    compute(manager, parent, parent.num_tokens)
    child = make_request("p#1", parent.prompt_token_ids)
    assert manager.fork(parent, child) is None
    assert manager.get_block_ids("p#1") == [1, 2]
    assert manager.block_pool.blocks[2].ref_cnt == 2
    with pytest.raises(ValueError, match="already holds blocks"):
        manager.fork(parent, child)


def test_fork_without_a_free_block_raises_and_changes_nothing():
    manager = KVCacheManager(num_blocks=3, block_size=BS)  # 2 usable
    parent = make_request("p", list(range(BS + 3)))
    compute(manager, parent, parent.num_tokens)
    child = make_request("p#1", parent.prompt_token_ids)
    with pytest.raises(NoFreeBlocksError):
        manager.fork(parent, child)
    assert manager.block_pool.blocks[1].ref_cnt == 1
    assert "p#1" not in manager.req_to_blocks


def test_cache_salt_separates_tenants():
    manager = KVCacheManager(num_blocks=20, block_size=BS)
    prompt = list(range(3 * BS + 1))
    admit(manager, make_request("a", prompt, cache_salt="tenant-a"))
    assert manager.get_computed_blocks(make_request("b", prompt, cache_salt="tenant-b"))[1] == 0
    assert manager.get_computed_blocks(make_request("n", prompt))[1] == 0
    assert manager.get_computed_blocks(make_request("a2", prompt, cache_salt="tenant-a"))[1] == 48


def test_caching_disabled():
    manager = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    prompt = list(range(40))
    admit(manager, make_request("a", prompt))
    assert manager.get_computed_blocks(make_request("b", prompt)) == ([], 0)
    assert manager.block_pool.cached_block_hash_to_block == {}


def test_prefix_stats_usage_and_reset():
    manager = KVCacheManager(num_blocks=11, block_size=BS)
    manager.record_prefix_lookup(100, 0)
    manager.record_prefix_lookup(50, 32)
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (150, 32)
    first = manager.take_prefix_stats()
    assert (first.queries, first.hits) == (150, 32)
    manager.record_prefix_lookup(10, 10)
    second = manager.take_prefix_stats()
    assert (second.queries, second.hits, second.hit_rate) == (10, 10, 1.0)
    assert manager.take_prefix_stats().hit_rate == 0.0

    req = make_request("a", list(range(40)))
    admit(manager, req)
    assert manager.usage == pytest.approx(0.3)
    assert list(manager.block_states()[:5]) == [1, 1, 1, 1, 0]
    assert manager.reset_prefix_cache() is False
    manager.free(req)
    assert list(manager.block_states()[:5]) == [1, 2, 2, 0, 0]
    assert manager.reset_prefix_cache() is True
    assert manager.get_computed_blocks(make_request("b", list(range(40))))[1] == 0
