"""Shared test helpers for engine/core: a paged fake model runner and invariant checks.

FakeRunner stands in for the model without mocking the scheduler's contract: it keeps a
real paged store (one token id per KV slot), applies blocks_to_copy, writes every scheduled
token into the slot its block table names, then "attends" by reading the whole history back
through the block table and samples next_token(history). A wrong block table, a bad prefix
hit, a missed copy-on-write or a block reused while still needed changes the history it
reads, so the generated tokens differ from reference_generate().
"""

from __future__ import annotations

from collections import Counter

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

VOCAB = 97


def next_token(history: list[int], sample_index: int = 0) -> int:
    """The fake model: a deterministic function of the token history."""
    return (sum(history) * 31 + len(history) + 7 * sample_index) % VOCAB


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    sample_index: int = 0,
    eos_token_id: int | None = None,
    max_model_len: int = 10**9,
) -> list[int]:
    """What the fake model generates for one request run alone (sample_index: which of n)."""
    history = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(history) < max_model_len:
        token = next_token(history, sample_index if not out else 0)
        out.append(token)
        history.append(token)
        if token == eos_token_id:
            break
    return out


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.slots: list[int | None] = [None] * (num_blocks * block_size)

    def slot(self, block_ids: list[int], pos: int) -> int:
        return block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for src, dst in out.blocks_to_copy:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        for sr in out.scheduled:  # write the whole batch's K/V first, as a real runner does
            assert 0 not in sr.block_ids, "the null block is never in a block table"
            for j, token in enumerate(sr.token_ids):
                self.slots[self.slot(sr.block_ids, sr.start_pos + j)] = token
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            end = sr.start_pos + len(sr.token_ids)
            history = [self.slot_value(sr.block_ids, p) for p in range(end)]
            expected = sr.prompt_token_ids + sr.output_token_ids
            assert history == expected, f"{sr.request_id}: KV read back differs from its tokens"
            sampled[sr.request_id] = [next_token(history, i) for i in range(sr.num_samples)]
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def slot_value(self, block_ids: list[int], pos: int) -> int | None:
        return self.slots[self.slot(block_ids, pos)]


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    *,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    **params,
) -> Request:
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        priority=priority,
        cache_salt=cache_salt,
    )
    if arrival_time is not None:
        req.arrival_time = arrival_time
    return req


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,  # default: what the pool holds, at most 256
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
) -> Scheduler:
    if max_model_len is None:
        max_model_len = min(256, (num_blocks - 1) * block_size)
    sched = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        policy=policy,
        enable_chunked_prefill=enable_chunked_prefill,
        block_size=block_size,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching)
    return Scheduler(sched, cache, num_blocks)


def check_invariants(scheduler: Scheduler) -> None:
    """Block and request bookkeeping that must hold between any two calls."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    free_set = set(free_ids)
    assert len(free_ids) == len(free_set) == pool.num_free_blocks
    assert 0 not in free_ids, "the null block is never free"
    held = Counter(b.block_id for blocks in manager.req_to_blocks.values() for b in blocks)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id} ref count"
        # Exactly one of two states: in the free queue (ref 0) or referenced.
        assert (block.ref_cnt == 0) == (block.block_id in free_set)
    assert pool.num_free_blocks + len(held) == pool.num_blocks - 1
    index = pool.cached_block_hash_to_block
    for block_hash, block in index.items():
        assert block.block_hash == block_hash
    assert sum(b.block_hash is not None for b in pool.blocks) == len(index)
    for rid, blocks in manager.req_to_blocks.items():
        assert manager.get_block_ids(rid) == [b.block_id for b in blocks]
        assert len(set(manager.get_block_ids(rid))) == len(blocks)
    running = {r.request_id for r in scheduler.running}
    waiting = {r.request_id for r in scheduler.waiting}
    assert len(running) == len(scheduler.running) and len(waiting) == len(scheduler.waiting)
    assert not running & waiting
    assert running | waiting == set(scheduler.requests)
    assert set(manager.req_to_blocks) <= running, "only running requests hold blocks"
    bs = manager.block_size
    for r in scheduler.running:
        assert len(manager.get_block_ids(r.request_id)) * bs >= r.num_computed_tokens
    for r in scheduler.waiting:
        assert r.num_computed_tokens == 0
    assert len(scheduler.running) <= scheduler.config.max_num_seqs


class Transcript:
    """Tokens and finish reasons per request id, collected from RequestUpdates."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finish: dict[str, str] = {}
        self.stop_reason: dict[str, int | str | None] = {}

    def add(self, updates) -> None:
        for u in updates:
            self.tokens.setdefault(u.request_id, []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                assert u.request_id not in self.finish, f"{u.request_id} finished twice"
                self.finish[u.request_id] = u.finish_reason
                self.stop_reason[u.request_id] = u.stop_reason


def step(scheduler: Scheduler, runner: FakeRunner, transcript: Transcript | None = None):
    out = scheduler.schedule()
    updates = scheduler.update_from_output(out, runner(out))
    if transcript is not None:
        transcript.add(updates)
    return out, updates


def run_until_done(
    scheduler: Scheduler, runner: FakeRunner, max_steps: int = 2000, check: bool = False
) -> Transcript:
    transcript = Transcript()
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return transcript
        step(scheduler, runner, transcript)
        if check:
            check_invariants(scheduler)
    raise AssertionError(f"not drained after {max_steps} steps")
