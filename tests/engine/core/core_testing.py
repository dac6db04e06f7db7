"""Shared test helpers for engine/core: a paged fake model runner and invariant checks.

FakeRunner stands in for the model without mocking the scheduler's contract: it keeps a
real paged store (one token id per KV slot) and the runner's real persistent input batch
(engine.worker.input_batch, fed only the incremental SchedulerOutputs), applies
blocks_to_copy, writes every scheduled token into the slot its block table names, then
"attends" by reading the whole history back through the block table and samples
next_token(history). A wrong block table, a bad prefix hit, a missed copy-on-write or a block
reused while still needed changes the history it reads, so the generated tokens differ from
reference_generate(). check_runner_state compares what the input batch rebuilt with the
scheduler's own view of every request after each step.
"""

from __future__ import annotations

from collections import Counter

from engine.config import CacheConfig, SchedulerConfig
from engine.core.request_queue import tenant_of
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import InputBatch

VOCAB = 97


def next_token(history: list[int], sample_index: int = 0, window: int | None = None) -> int:
    """The fake model: a deterministic function of the token history (with a sliding window:
    of its last `window` tokens and its length only)."""
    seen = history if window is None else history[-window:]
    return (sum(seen) * 31 + len(history) + 7 * sample_index) % VOCAB


def reference_generate(
    prompt: list[int],
    max_tokens: int,
    sample_index: int = 0,
    eos_token_id: int | None = None,
    max_model_len: int = 10**9,
    window: int | None = None,
) -> list[int]:
    """What the fake model generates for one request run alone (sample_index: which of n)."""
    history = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(history) < max_model_len:
        token = next_token(history, sample_index if not out else 0, window)
        out.append(token)
        history.append(token)
        if token == eos_token_id:
            break
    return out


class FakeRunner:
    """window: a sliding-window model. Each scheduled chunk then reads back the keys its
    queries attend, positions from start - window + 1 to its end, through its block table
    (the entries before them may name freed blocks, since reused: never read), and the
    fake model sees only the last `window` tokens."""

    def __init__(self, num_blocks: int, block_size: int, window: int | None = None) -> None:
        self.block_size = block_size
        self.window = window
        self.slots: list[int | None] = [None] * (num_blocks * block_size)
        self.batch = InputBatch()
        self.step_tokens: dict[str, list[int]] = {}  # the token ids each request computed last

    def slot(self, block_ids, pos: int) -> int:
        return int(block_ids[pos // self.block_size]) * self.block_size + pos % self.block_size

    def block_table(self, request_id: str) -> list[int]:
        """The block table the runner rebuilt for a request it holds."""
        return self.batch[request_id].block_table.tolist()

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        self.batch.update(out)
        for src, dst in out.blocks_to_copy:
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        self.step_tokens = {}
        for sr in out.scheduled:  # write the whole batch's K/V first, as a real runner does
            state = self.batch[sr.request_id]
            table = state.block_table
            first = 0 if self.window is None else max(0, sr.start_pos - self.window + 1)
            end = sr.start_pos + sr.num_tokens
            needed = table[first // bs : -(-end // bs)]
            assert 0 not in needed, "the null block is never read nor written"
            tokens = state.token_ids[sr.start_pos : sr.start_pos + sr.num_tokens]
            assert len(tokens) == sr.num_tokens
            self.step_tokens[sr.request_id] = tokens
            for j, token in enumerate(tokens):
                self.slots[self.slot(table, sr.start_pos + j)] = token
        if self.window is not None:  # every chunk's queries read their windows' keys
            for sr in out.scheduled:
                state = self.batch[sr.request_id]
                end = sr.start_pos + sr.num_tokens
                first = max(0, sr.start_pos - self.window + 1)
                seen = [self.slot_value(state.block_table, p) for p in range(first, end)]
                assert seen == state.token_ids[first:end], f"{sr.request_id}: a window's KV"
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            state = self.batch[sr.request_id]
            end = sr.start_pos + sr.num_tokens
            assert end == len(state.token_ids), f"{sr.request_id}: samples before its last token"
            expected = state.prompt_token_ids + state.output_token_ids
            first = 0 if self.window is None else max(0, end - self.window)
            history = [self.slot_value(state.block_table, p) for p in range(first, end)]
            assert history == expected[first:], f"{sr.request_id}: KV read back differs"
            sampled[sr.request_id] = [
                next_token(expected, i, self.window) for i in range(sr.num_samples)
            ]
        self.batch.append_sampled(sampled)  # what a rank-0 runner does after sampling
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def slot_value(self, block_ids, pos: int) -> int | None:
        return self.slots[self.slot(block_ids, pos)]


def check_runner_state(scheduler: Scheduler, runner: FakeRunner) -> None:
    """After a step: every request the runner's input batch holds that the scheduler still
    runs has exactly the scheduler's tokens and block table; the others are finished ones
    whose drop comes with the next SchedulerOutput."""
    manager = scheduler.kv_cache_manager
    pending = set(scheduler._finished_ids)
    for rid, state in runner.batch.requests.items():
        request = scheduler.get_request(rid)
        if request is None:
            assert rid in pending, f"the runner holds {rid!r}, which the scheduler forgot"
            continue
        assert request.status == RequestStatus.RUNNING, f"the runner holds {rid!r} not running"
        assert state.token_ids == request.all_token_ids, rid
        assert state.prompt_token_ids == request.prompt_token_ids, rid
        assert state.output_token_ids == request.output_token_ids, rid
        # Blocks dropped behind a sliding window: the null block in the scheduler's table,
        # the runner's still names them (it is sent appended ids only) and never reads them.
        dropped = manager.num_dropped_blocks.get(rid, 0)
        assert state.block_table.tolist()[dropped:] == manager.get_block_ids(rid)[dropped:], rid
        assert state.sampling_params == request.sampling_params, rid
        assert state.eos_token_id == request.eos_token_id, rid


def make_request(
    request_id: str,
    prompt: list[int],
    max_tokens: int | None = 16,
    *,
    eos_token_id: int | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    cache_salt: str | None = None,
    tenant: str | None = None,
    tenant_weight: float = 1.0,
    deadline: float | None = None,
    **params,
) -> Request:
    req = Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        priority=priority,
        cache_salt=cache_salt,
        tenant=tenant,
        tenant_weight=tenant_weight,
        deadline=deadline,
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
    sliding_window: int | None = None,
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
    return Scheduler(sched, cache, num_blocks, sliding_window=sliding_window)


def check_invariants(scheduler: Scheduler) -> None:
    """Block and request bookkeeping that must hold between any two calls."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    free_set = set(free_ids)
    assert len(free_ids) == len(free_set) == pool.num_free_blocks
    assert 0 not in free_ids, "the null block is never free"
    null = pool.null_block  # in the tables of requests past a sliding window: not a hold
    held = Counter(
        b.block_id for blocks in manager.req_to_blocks.values() for b in blocks if b is not null
    )
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
        dropped = manager.num_dropped_blocks.get(rid, 0)
        assert all(b is null for b in blocks[:dropped]) and null not in blocks[dropped:]
        assert len(set(manager.get_block_ids(rid)[dropped:])) == len(blocks) - dropped
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
    counters = scheduler.tenant_counters
    if counters is not None:  # "fair": the backlog counts are the waiting queue's
        backlog = Counter(tenant_of(r) for r in scheduler.waiting)
        assert counters._num_waiting == dict(backlog)


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
    check_runner_state(scheduler, runner)
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
