"""The KV cache manager under a sliding window (every layer windowed): exact block ids of
the blocks freed behind the window, a long request's bounded block count, prefix hits on
dropped blocks, forks, and the scheduler end to end against a windowed fake model."""

from __future__ import annotations

import random

import pytest
from core_testing import (
    FakeRunner,
    check_invariants,
    make_request,
    make_scheduler,
    reference_generate,
    run_until_done,
    step,
)

from engine.core.kv_cache_manager import KVCacheManager, blocks_per_request
from engine.request import Request

BS = 16
W = 40  # a window of 2.5 blocks


def free_ids(manager: KVCacheManager) -> list[int]:
    return [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]


def compute(manager: KVCacheManager, req: Request, num_new: int, hit=None) -> list[int]:
    """One step as the scheduler runs it: allocate, advance, (forward), cache."""
    new = manager.allocate_slots(req, num_new, hit)
    assert new is not None
    req.num_computed_tokens += len(hit or []) * BS + num_new
    manager.cache_blocks(req)
    return [b.block_id for b in new]


def decode(manager: KVCacheManager, req: Request, token: int = 7) -> list[int]:
    """Append a sampled token and compute it."""
    req.append_output_token(token)
    return compute(manager, req, 1)


def test_blocks_behind_the_window_are_freed_and_a_long_request_stays_bounded():
    manager = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    req = make_request("a", list(range(50)), max_tokens=None)  # 3 full blocks + 2 tokens
    assert compute(manager, req, 50) == [1, 2, 3, 4]
    assert manager.get_block_ids("a") == [1, 2, 3, 4]  # nothing behind the first query's window
    # Query i attends keys i - 39 .. i. Position 50 reads from 11: the first block (0..15)
    # stays until position 55, which reads from 16.
    decode(manager, req)  # computes position 50
    assert manager.get_block_ids("a") == [1, 2, 3, 4] and req.num_computed_tokens == 51
    for _ in range(4):
        decode(manager, req)  # positions 51..54
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    decode(manager, req)  # position 55: block 1 freed before it is allocated
    assert manager.get_block_ids("a") == [0, 2, 3, 4] and manager.num_held_blocks("a") == 3
    # block 1 is cached (full, computed): freed to the tail of the queue, still a hit
    assert free_ids(manager)[-1] == 1 and manager.block_pool.blocks[1].block_hash is not None
    # Position 64 takes a new block; block 2 (16..31) goes at position 71 (reads from 32).
    for _ in range(64 - 56):
        decode(manager, req)  # 56..63
    assert decode(manager, req) == [5]  # position 64
    assert manager.get_block_ids("a") == [0, 2, 3, 4, 5]
    for _ in range(70 - 64):
        decode(manager, req)  # 65..70
    assert manager.get_block_ids("a") == [0, 2, 3, 4, 5]
    decode(manager, req)  # position 71
    assert manager.get_block_ids("a") == [0, 0, 3, 4, 5]
    # A long generation: never more than ceil(W / BS) + 1 blocks held, table positional.
    most = 0
    for _ in range(400):
        decode(manager, req)
        most = max(most, manager.num_held_blocks("a"))
        pos = req.num_computed_tokens - 1
        assert len(manager.get_block_ids("a")) == pos // BS + 1
        held = [b for b in manager.get_block_ids("a") if b]
        assert len(held) == manager.num_held_blocks("a")
    assert most == -(-W // BS) + 1 == 4
    assert manager.num_free_blocks == 11 - manager.num_held_blocks("a")
    manager.free(req)
    assert manager.num_free_blocks == 11 and manager.num_dropped_blocks == {}


def test_a_chunked_prefill_past_the_window_frees_behind_each_chunk():
    manager = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    req = make_request("a", list(range(100)), max_tokens=None)
    assert compute(manager, req, 32) == [1, 2]  # chunk 0..31
    assert compute(manager, req, 32) == [3, 4]  # chunk 32..63: its first query reads from 0
    # chunk 64..95: the first query (64) attends 25..64: block 0 (0..15) is out, block 1 not
    assert compute(manager, req, 32) == [5, 6]
    assert manager.get_block_ids("a") == [0, 2, 3, 4, 5, 6]
    # the last 4 tokens: the first query (96) attends 57..96: blocks 1..2 (16..47) out too
    assert compute(manager, req, 4) == [7]
    assert manager.get_block_ids("a") == [0, 0, 0, 4, 5, 6, 7]
    # a chunk holds the blocks its whole span needs, whatever the window
    assert manager.num_held_blocks("a") == 4


def test_prefix_hits_on_dropped_blocks_are_whole_chains_and_skip_what_is_behind_the_window():
    manager = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    prompt = [i // BS + 100 for i in range(4 * BS)] + [1, 2, 3]  # 4 full blocks + 3
    a = make_request("a", prompt, max_tokens=None)
    assert compute(manager, a, len(prompt)) == [1, 2, 3, 4, 5]
    for _ in range(30):
        decode(manager, a)
    assert manager.get_block_ids("a")[:2] == [0, 0]  # blocks 1, 2 dropped but still cached
    assert manager.block_pool.blocks[1].ref_cnt == 0 and manager.block_pool.blocks[1].block_hash
    # b shares the prompt: its hit is the whole chain of 4 blocks (1, 2 freed but cached)
    b = make_request("b", prompt, max_tokens=None)
    hit, num_hit = manager.get_computed_blocks(b)
    assert [x.block_id for x in hit] == [1, 2, 3, 4] and num_hit == 64
    # b's first new token (64) attends 25..64: blocks 1 (0..15) is not taken, 2 (16..31) is
    new = compute(manager, b, len(prompt) - num_hit, hit)
    assert manager.get_block_ids("b")[:4] == [0, 2, 3, 4] and len(new) == 1
    assert manager.block_pool.blocks[1].ref_cnt == 0 and manager.block_pool.blocks[2].ref_cnt == 1
    assert manager.num_dropped_blocks["b"] == 1
    # a's dropped blocks get reused: the chain breaks there, a later hit is shorter (none)
    manager.free(b)
    manager.free(a)
    first_hash = manager.block_pool.blocks[1].block_hash
    c = make_request("c", [5] * (14 * BS), max_tokens=None)  # takes every free block
    compute(manager, c, 14 * BS)
    assert first_hash not in manager.block_pool.cached_block_hash_to_block  # evicted
    manager.free(c)
    d = make_request("d", prompt, max_tokens=None)
    assert manager.get_computed_blocks(d)[1] == 0


def test_a_block_dropped_before_it_was_cached_is_never_cached():
    """Async scheduling counts a step in flight as computed: the window can pass a block
    before update_from_output caches it. It is then freed unhashed (reused first), and the
    null block in its place is never registered."""
    manager = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=W)
    req = make_request("a", list(range(80)), max_tokens=None)
    manager.allocate_slots(req, 80)
    req.num_computed_tokens = 80  # scheduled, not cached yet
    req.append_output_token(1)
    # position 80 attends 41..80: blocks 1, 2 (0..31) out, freed unhashed to the head of
    # the queue, reused first: block 1 at once, for position 80's own block
    assert [b.block_id for b in manager.allocate_slots(req, 1)] == [1]
    assert manager.get_block_ids("a") == [0, 0, 3, 4, 5, 1] and free_ids(manager)[0] == 2
    manager.cache_blocks(req, 80)
    pool = manager.block_pool
    assert pool.null_block.block_hash is None and len(pool.cached_block_hash_to_block) == 3
    assert manager.get_computed_blocks(make_request("b", list(range(80))))[1] == 0


def test_fork_shares_the_window_and_not_the_null_block():
    manager = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=W)
    parent = make_request("p", list(range(70)), max_tokens=None)
    compute(manager, parent, 70)
    parent.append_output_token(1)
    compute(manager, parent, 1)  # position 70 attends 31..70: block 0 out
    assert manager.get_block_ids("p") == [0, 2, 3, 4, 5]
    child = make_request("c", list(range(70)), max_tokens=None)
    child.append_output_token(1)
    child.num_computed_tokens = parent.num_computed_tokens
    copy = manager.fork(parent, child)
    assert copy is not None and copy[0] == 5
    assert manager.get_block_ids("c") == [0, 2, 3, 4, copy[1]]
    assert manager.num_dropped_blocks["c"] == 1
    assert [manager.block_pool.blocks[i].ref_cnt for i in (2, 3, 4, 5)] == [2, 2, 2, 1]
    manager.free(child)
    manager.free(parent)
    assert manager.num_free_blocks == 15


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("budget", [256, 24], ids=["whole-prompts", "chunked"])
@pytest.mark.parametrize("num_blocks", [24, 14], ids=["roomy", "preempting"])
def test_scheduler_end_to_end_under_a_window(prefix_caching, budget, num_blocks):
    """Requests longer than the window, shared prefixes, chunked prefill and (with a small
    cache) preemption: every chunk reads its window's K/V back intact through its table, the
    tokens are the windowed fake model's, and no request ever holds more blocks than its
    window and its chunk need."""
    window = 24
    rng = random.Random(7)
    sched = make_scheduler(
        num_blocks=num_blocks,
        max_num_batched_tokens=budget,
        max_model_len=(num_blocks - 1) * BS,
        max_num_seqs=6,
        enable_prefix_caching=prefix_caching,
        sliding_window=window,
    )
    runner = FakeRunner(num_blocks, BS, window=window)
    shared = [rng.randrange(97) for _ in range(3 * BS + 5)]
    prompts = {}
    for i in range(10):
        own = [rng.randrange(97) for _ in range(rng.randint(1, 40))]
        prompts[str(i)] = shared + own if i % 2 == 0 else own
        sched.add_request(make_request(str(i), prompts[str(i)], max_tokens=rng.randint(30, 90)))
    expected = {
        rid: reference_generate(p, sched.get_request(rid).sampling_params.max_tokens, window=window)
        for rid, p in prompts.items()
    }
    manager = sched.kv_cache_manager
    done = {}
    for _ in range(3000):
        if not sched.has_unfinished_requests():
            break
        out, updates = step(sched, runner)
        check_invariants(sched)
        for u in updates:
            done.setdefault(u.request_id, []).extend(u.new_token_ids)
        for sr in out.scheduled:  # the blocks of the chunk's span, the window before it
            first = max(0, sr.start_pos - window + 1) // BS
            span = -(-(sr.start_pos + sr.num_tokens) // BS) - first
            assert manager.num_held_blocks(sr.request_id) <= span
            if sr.num_tokens == 1:
                assert manager.num_held_blocks(sr.request_id) <= -(-window // BS) + 1
    assert done == expected
    if num_blocks == 14:
        assert sched.num_preemptions > 0
    elif prefix_caching:
        assert manager.prefix_cache_hits > 0


def test_run_until_done_without_window_is_unchanged():
    """The windowed fake model and runner are opt-in: the plain ones still agree."""
    sched = make_scheduler(num_blocks=32)
    runner = FakeRunner(32, BS)
    sched.add_request(make_request("x", list(range(40)), max_tokens=20))
    transcript = run_until_done(sched, runner, check=True)
    assert transcript.tokens["x"] == reference_generate(list(range(40)), 20)


def test_a_windowed_model_needs_a_cache_for_its_window_and_chunk_only():
    """One request's most blocks at once: its whole context without a window or without
    chunked prefill (a whole prompt at once); else the window behind a chunk plus the chunk,
    at the worst alignment. A cache that small serves a long context."""
    assert blocks_per_request(4096, BS) == 256
    assert blocks_per_request(4096, BS, W, None) == 256
    for window in (1, 15, 16, 17, 40):
        for chunk in (1, 5, 16, 64):
            worst = max(
                (p + chunk - 1) // BS - max(0, p - window + 1) // BS + 1 for p in range(300)
            )
            assert blocks_per_request(4096, BS, window, chunk) == worst, (window, chunk)
    assert blocks_per_request(40, BS, W, 64) == 3  # never more than the context's
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len"):
        make_scheduler(num_blocks=10, max_model_len=4096, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="window"):
        make_scheduler(
            num_blocks=8, max_model_len=4096, max_num_batched_tokens=64, sliding_window=W
        )
    sched = make_scheduler(
        num_blocks=9, max_model_len=4096, max_num_batched_tokens=64, sliding_window=W
    )
    runner = FakeRunner(9, BS, window=W)
    prompt = [i % 97 for i in range(300)]
    sched.add_request(make_request("long", prompt, max_tokens=200))
    transcript = run_until_done(sched, runner, check=True)
    assert transcript.tokens["long"] == reference_generate(prompt, 200, window=W)
