"""The scheduler's side of n-gram speculative decoding, with a fake paged runner (no model):
drafts are scheduled with their KV slots and counted in the budget, rejected positions are
rolled back, only blocks of real computed tokens reach the prefix cache, and no block leaks
or is freed twice, under random acceptance, preemption, chunked prefill and prefix hits."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from core_testing import FakeRunner, check_invariants, check_runner_state, make_request  # noqa: E402

from engine.config import CacheConfig, SchedulerConfig  # noqa: E402
from engine.core.kv_cache_utils import extend_block_hashes  # noqa: E402
from engine.core.scheduler import Scheduler  # noqa: E402
from engine.outputs import ModelRunnerOutput, SchedulerOutput  # noqa: E402
from engine.request import Request  # noqa: E402
from engine.spec_decode import SpeculativeConfig  # noqa: E402

PERIOD = 7
VOCAB = 50


def copy_model(history: list[int]) -> int:
    """A fake model that mostly copies: the token PERIOD back, bent now and then."""
    if len(history) % 5 == 0 or len(history) < PERIOD:
        return (sum(history[-3:]) * 13 + 1) % VOCAB
    return history[-PERIOD]


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    history, out = list(prompt), []
    while len(out) < max_tokens:
        out.append(copy_model(history))
        history.append(out[-1])
    return out


class SpecRunner(FakeRunner):
    """FakeRunner with drafts: writes the step's known tokens and drafts into their slots,
    reads each verification position's history back through the block table, and keeps
    drafts while they match the model (greedy), or a random number of them (accept_rng)."""

    def __init__(self, num_blocks, block_size, accept_rng: random.Random | None = None, model=None):
        super().__init__(num_blocks, block_size)
        self.accept_rng = accept_rng
        self.model = model or copy_model

    def __call__(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.batch.update(out)
        for src, dst in out.blocks_to_copy:
            bs = self.block_size
            self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
        for sr in out.scheduled:
            state = self.batch[sr.request_id]
            table = state.block_table
            assert 0 not in table
            n_known = sr.num_tokens - len(sr.spec_token_ids)
            tokens = state.token_ids[sr.start_pos : sr.start_pos + n_known] + sr.spec_token_ids
            assert len(tokens) == sr.num_tokens
            for j, token in enumerate(tokens):
                self.slots[self.slot(table, sr.start_pos + j)] = token
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if not sr.sample:
                continue
            state = self.batch[sr.request_id]
            drafts = sr.spec_token_ids
            base = sr.start_pos + sr.num_tokens - len(drafts)
            assert base == len(state.token_ids)
            history = [self.slot_value(state.block_table, p) for p in range(base)]
            assert history == state.token_ids, f"{sr.request_id}: KV read back differs"
            emitted = []
            if self.accept_rng is not None and drafts:
                a = self.accept_rng.randint(0, len(drafts))
                emitted = drafts[:a] + [self.accept_rng.randrange(VOCAB)]
            else:
                for j in range(len(drafts) + 1):
                    ctx = history + drafts[:j]
                    back = [self.slot_value(state.block_table, p) for p in range(len(ctx))]
                    assert back == ctx
                    target = self.model(ctx)
                    emitted.append(target)
                    if j == len(drafts) or drafts[j] != target:
                        break
            sampled[sr.request_id] = emitted
        self.batch.append_sampled(sampled)
        return ModelRunnerOutput(sampled_token_ids=sampled)


def make(
    num_blocks=40,
    block_size=8,
    budget=64,
    max_model_len=120,
    k=3,
    caching=True,
    cutoff=None,
    adaptive=False,
    clock=None,
    max_num_seqs=8,
):
    """adaptive False by default: drafts at every step, the drafting itself under test."""
    spec = SpeculativeConfig(
        num_speculative_tokens=k,
        prompt_lookup_max=3,
        disable_by_batch_size=cutoff,
        adaptive=adaptive,
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        block_size=block_size,
        speculative_config=spec,
    )
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)
    if clock is None:
        return Scheduler(config, cache, num_blocks)
    return Scheduler(config, cache, num_blocks, clock=clock)


def check_cached_hashes(scheduler: Scheduler) -> None:
    """Every block a running request has registered holds the hash of its real tokens."""
    manager = scheduler.kv_cache_manager
    bs = manager.block_size
    for request in scheduler.running:
        rid = request.request_id
        num_cached = manager.num_cached_blocks.get(rid, 0)
        assert num_cached * bs <= request.num_computed_tokens <= request.num_tokens
        fresh = Request(rid, list(request.all_token_ids), request.sampling_params)
        fresh.cache_salt = request.cache_salt
        extend_block_hashes(fresh, bs)
        for i, block in enumerate(manager.req_to_blocks[rid][:num_cached]):
            assert block.block_hash == fresh.block_hashes[i], (rid, i)


def drive(scheduler, runner, requests, check=True, limit=2000):
    for r in requests:
        scheduler.add_request(r)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps = 0
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for sr in so.scheduled:
            assert sr.num_tokens >= 1 + len(sr.spec_token_ids)
            if sr.spec_token_ids:
                assert sr.sample
        assert so.num_batched_tokens == sum(sr.num_tokens for sr in so.scheduled)
        assert so.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for u in scheduler.update_from_output(so, runner(so)):
            outputs[u.request_id] += u.new_token_ids
        if check:
            check_invariants(scheduler)
            check_runner_state(scheduler, runner)
            check_cached_hashes(scheduler)
        steps += 1
        assert steps < limit
    return outputs, steps


def _prompts(rng: random.Random, count: int) -> list[list[int]]:
    out = []
    for _ in range(count):
        unit = [rng.randrange(VOCAB) for _ in range(PERIOD)]
        out.append(unit * rng.randint(1, 4) + unit[: rng.randint(0, PERIOD)])
    return out


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("num_blocks,budget", [(40, 64), (16, 64), (40, 8)])
def test_greedy_exact_with_acceptances(caching, num_blocks, budget):
    rng = random.Random(num_blocks * 100 + budget)
    prompts = _prompts(rng, 6)
    prompts.append(prompts[0] + [1, 2, 3])  # a prefix hit (when caching)
    requests = [
        make_request(f"r{i}", p, max_tokens=rng.randint(1, 30), temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    scheduler = make(num_blocks=num_blocks, budget=budget, caching=caching)
    free0 = scheduler.kv_cache_manager.num_free_blocks
    runner = SpecRunner(num_blocks, 8)
    outputs, _ = drive(scheduler, runner, requests)
    for r, prompt in zip(requests, prompts, strict=True):
        assert outputs[r.request_id] == reference(prompt, r.sampling_params.max_tokens)
    stats = scheduler.stats().spec_decoding
    assert stats.num_accepted_tokens > 0
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # some were rejected too
    assert scheduler.kv_cache_manager.num_free_blocks == free0
    if num_blocks == 16:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("seed", range(4))
def test_random_acceptance_block_accounting(seed):
    """Property-style: random prompts, lengths and acceptance counts; the invariants hold
    after every step and every block is free again at the end."""
    rng = random.Random(seed)
    num_blocks = rng.choice([16, 24, 40])
    budget = rng.choice([8, 16, 64])
    scheduler = make(num_blocks=num_blocks, budget=budget, k=rng.randint(1, 5))
    free0 = scheduler.kv_cache_manager.num_free_blocks
    runner = SpecRunner(num_blocks, 8, accept_rng=rng)
    prompts = _prompts(rng, 8)
    requests = [
        make_request(f"r{i}", p, max_tokens=rng.randint(1, 40), temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    outputs, _ = drive(scheduler, runner, requests)
    for r in requests:
        assert len(outputs[r.request_id]) == r.sampling_params.max_tokens  # never more
    assert scheduler.kv_cache_manager.num_free_blocks == free0
    assert scheduler.stats().spec_decoding.num_draft_tokens > 0


def test_no_drafts_where_unsupported():
    """n > 1, seeded requests and max_tokens' last token get no drafts."""
    scheduler = make()
    prompt = [1, 2, 3, 4] * 4
    scheduler.add_request(make_request("seeded", prompt, max_tokens=8, temperature=1.0, seed=1))
    scheduler.add_request(make_request("fork", prompt, max_tokens=8, temperature=1.0, n=2))
    scheduler.add_request(make_request("last", prompt, max_tokens=2, temperature=0.0))
    scheduler.add_request(make_request("plain", prompt, max_tokens=8, temperature=0.0))
    runner = SpecRunner(40, 8)
    seen: dict[str, list[int]] = {}
    for _ in range(4):
        so = scheduler.schedule()
        for sr in so.scheduled:
            seen.setdefault(sr.request_id.split("#")[0].split("-")[0], []).append(
                len(sr.spec_token_ids)
            )
        scheduler.update_from_output(so, runner(so))
    assert not any(seen["seeded"]) and not any(seen["fork"]) and not any(seen["last"])
    assert any(seen["plain"])
    assert max(seen["plain"]) <= 3


def test_drafts_never_preempt():
    """Where the drafts' slots would need a block nobody has free, the drafts go, not a
    running request."""
    scheduler = make(num_blocks=3, budget=64, max_model_len=16)
    runner = SpecRunner(3, 8)
    scheduler.add_request(make_request("a", [1, 2, 3, 1, 2, 3, 1], max_tokens=8, temperature=0.0))
    scheduler.add_request(make_request("b", [9, 8, 7, 6, 5], max_tokens=2, temperature=0.0))
    so = scheduler.schedule()  # both prefills: one block each, none left
    scheduler.update_from_output(so, runner(so))
    assert scheduler.kv_cache_manager.num_free_blocks == 0
    so = scheduler.schedule()
    by_id = {sr.request_id: sr for sr in so.scheduled}
    assert by_id["a"].num_tokens == 1 and by_id["a"].spec_token_ids == []
    assert scheduler.num_preemptions == 0 and "b" in by_id
    scheduler.update_from_output(so, runner(so))
    check_invariants(scheduler)


def test_large_batches_draft_nothing_under_disable_by_batch_size():
    """disable_by_batch_size 3: no drafts in steps of 3 or more running requests, drafts
    again once fewer run; the tokens stay the model's either way."""
    rng = random.Random(5)
    prompts = _prompts(rng, 4)
    requests = [
        make_request(f"r{i}", p, max_tokens=6 + 12 * (i == 0), temperature=0.0)
        for i, p in enumerate(prompts)
    ]
    scheduler, runner = make(cutoff=3), SpecRunner(40, 8)
    for r in requests:
        scheduler.add_request(r)
    drafted_at: list[tuple[int, bool]] = []
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        drafted_at.append((len(scheduler.running), any(sr.spec_token_ids for sr in so.scheduled)))
        for u in scheduler.update_from_output(so, runner(so)):
            outputs[u.request_id] += u.new_token_ids
    assert not any(drafted for running, drafted in drafted_at if running >= 3)
    assert any(drafted for running, drafted in drafted_at if running < 3)
    for r, prompt in zip(requests, prompts, strict=True):
        assert outputs[r.request_id] == reference(prompt, r.sampling_params.max_tokens)
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        SpeculativeConfig(disable_by_batch_size=0)


class StepClock:
    """The scheduler's clock in a test: time moves only when the test charges a step's cost."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def drive_timed(scheduler, runner, clock, cost, requests, limit=5000):
    """drive() with each step charged cost(step) on the clock between schedule and update;
    returns the outputs, each step's (decode-only, draft rows, first request's position) and
    the counts the spec
    counters should hold: (requests with drafts, draft tokens, kept drafts, per position)."""
    for r in requests:
        scheduler.add_request(r)
    outputs: dict[str, list[int]] = {r.request_id: [] for r in requests}
    steps: list[tuple[bool, int]] = []
    k = scheduler.config.speculative_config.num_speculative_tokens
    counts = [0, 0, 0, [0] * k]
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        clock.now += cost(so)
        ro = runner(so)
        for sr in so.scheduled:
            if sr.spec_token_ids:
                kept = len(ro.sampled_token_ids[sr.request_id]) - 1
                counts[0] += 1
                counts[1] += len(sr.spec_token_ids)
                counts[2] += kept
                for j in range(kept):
                    counts[3][j] += 1
        decode = all(sr.num_tokens == 1 + len(sr.spec_token_ids) for sr in so.scheduled)
        steps.append((decode, _draft_rows(so), so.scheduled[0].start_pos if so.scheduled else 0))
        for u in scheduler.update_from_output(so, ro):
            outputs[u.request_id] += u.new_token_ids
        check_invariants(scheduler)
        check_runner_state(scheduler, runner)
        assert len(steps) < limit
    return outputs, steps, counts


def _draft_rows(so: SchedulerOutput) -> int:
    return sum(len(sr.spec_token_ids) for sr in so.scheduled)


def _copy_requests(seed: int, count: int, max_tokens: int):
    rng = random.Random(seed)
    prompts = _prompts(rng, count)
    return prompts, [
        make_request(f"r{i}", p, max_tokens=max_tokens, temperature=0.0)
        for i, p in enumerate(prompts)
    ]


def _check_counters(scheduler, counts):
    stats = scheduler.stats().spec_decoding
    assert [stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens] == counts[:3]
    assert stats.accepted_per_pos == counts[3]


def test_no_drafts_after_warm_up_where_drafting_loses():
    """A compute-bound cost model: each draft row costs as much as a whole plain step, so a
    drafted step emits fewer tokens per second whatever is kept. After each batch size's
    warm-up, only the controller's probes (one decision in 16) carry drafts; the tokens are
    the model's and the spec counters count exactly the drafts scheduled."""
    clock = StepClock()
    scheduler = make(adaptive=True, clock=clock, max_model_len=200, num_blocks=80)
    prompts, requests = _copy_requests(7, 4, 70)
    outputs, steps, counts = drive_timed(
        scheduler, SpecRunner(80, 8), clock, lambda so: 1.0 + 1.0 * _draft_rows(so), requests
    )
    for r, prompt in zip(requests, prompts, strict=True):
        assert outputs[r.request_id] == reference(prompt, 70)
    controller = scheduler.draft_controller
    assert controller.pays(4) is False
    drafted = [i for i, (_, rows, _) in enumerate(steps) if rows]
    # the warm-up in the bucket of 4 requests (again while its steps carry a prefill), in
    # those of 1-3 as requests end, then probes only
    warm_ups = len(controller.buckets)
    assert len([i for i in drafted if i > 8]) <= warm_ups + controller.num_probes
    assert controller.num_probes <= controller.num_decisions // 16
    assert len(drafted) < len(steps) / 8
    _check_counters(scheduler, counts)
    stats = scheduler.stats().spec_decoding  # what /metrics exports of the decisions
    assert stats.controller_draft_steps == controller.num_drafting
    assert stats.controller_plain_steps == controller.num_decisions - controller.num_drafting
    assert stats.controller_plain_steps > 7 * stats.controller_draft_steps
    assert counts[0] > 0  # the warm-up and the probes did draft
    # the declined steps still measured the acceptance, on unverified proposals
    assert scheduler.shadow_drafts.num_settled > len(drafted)
    assert len(scheduler.shadow_drafts) == 0  # nothing left of the finished requests


@pytest.mark.parametrize("num_blocks,budget", [(40, 64), (16, 64), (40, 8)])
def test_drafts_where_drafting_pays_exact_under_preemption_and_chunks(num_blocks, budget):
    """A memory-bound cost model (a step costs the same whatever its rows): drafting wins
    on copying text, so the steps draft but for the probes; greedy outputs stay the
    model's under preemption (16 blocks) and chunked prefill (budget 8)."""
    clock = StepClock()
    scheduler = make(num_blocks=num_blocks, budget=budget, adaptive=True, clock=clock)
    free0 = scheduler.kv_cache_manager.num_free_blocks
    prompts, requests = _copy_requests(num_blocks + budget, 6, 30)
    outputs, steps, counts = drive_timed(
        scheduler, SpecRunner(num_blocks, 8), clock, lambda so: 1.0, requests
    )
    for r, prompt in zip(requests, prompts, strict=True):
        assert outputs[r.request_id] == reference(prompt, 30)
    assert scheduler.kv_cache_manager.num_free_blocks == free0
    controller = scheduler.draft_controller
    # plain decisions: the probes and each bucket's warm-up (repeated while a plain
    # warm-up step also carried a prompt chunk, and so was not measured)
    assert controller.num_drafting >= 0.8 * controller.num_decisions
    assert controller.pays(1) is True
    _check_counters(scheduler, counts)
    assert counts[2] > 0
    if num_blocks == 16:
        assert scheduler.num_preemptions > 0


def test_the_controller_only_times_pure_decode_steps():
    """A step with a prompt chunk in it is not measured (its time says nothing about
    drafting); the hard cutoff (disable_by_batch_size) still wins over the controller."""
    clock = StepClock()
    scheduler = make(adaptive=True, clock=clock, budget=8)
    _, requests = _copy_requests(3, 2, 4)
    drive_timed(scheduler, SpecRunner(40, 8), clock, lambda so: 1.0, requests)
    measured = scheduler.draft_controller.buckets
    assert measured and all(b.plain_s in (None, 0.5, 1.0) for b in measured.values())
    cut = make(adaptive=True, clock=StepClock(), cutoff=1)
    _, requests = _copy_requests(3, 2, 6)
    _, steps, counts = drive_timed(cut, SpecRunner(40, 8), StepClock(), lambda so: 1.0, requests)
    assert counts[0] == 0 and cut.draft_controller.num_decisions == 0


def test_drafting_resumes_when_the_text_turns_to_copying():
    """One request; a draft row costs 0.45 of a plain step, so drafting pays only above that
    acceptance. Its first 60 tokens are scrambled (the n-gram drafts are rejected: drafting
    stops), then the model copies (the shadow proposals see it: drafting resumes within a
    few steps, not only at the next probe)."""
    switch = 100

    def model(history):
        if len(history) < switch:
            return (sum(history[-4:]) * 31 + len(history) * 7) % VOCAB
        return history[-PERIOD]

    clock = StepClock()
    scheduler = make(adaptive=True, clock=clock, max_model_len=240, num_blocks=60)
    rng = random.Random(11)
    prompt = [rng.randrange(VOCAB) for _ in range(40)]
    request = make_request("r", prompt, max_tokens=150, temperature=0.0)
    runner = SpecRunner(60, 8, model=model)
    _, steps, counts = drive_timed(
        scheduler, runner, clock, lambda so: 1.0 + 0.45 * _draft_rows(so), [request]
    )
    _check_counters(scheduler, counts)
    drafted = {pos: rows > 0 for decode, rows, pos in steps if decode}
    scrambled = [d for pos, d in drafted.items() if 60 <= pos < switch]
    assert sum(scrambled) <= 3 and len(scrambled) > 30  # the probes only
    resumed = min(
        p for p in drafted if p >= switch and all(drafted.get(q, True) for q in range(p, p + 8))
    )
    # a few shadow proposals settled (the back-off may hold the first a while); on the
    # probes alone it took 63 steps
    assert resumed < switch + 32
    copying = [d for pos, d in drafted.items() if pos >= resumed]
    assert sum(copying) >= 0.8 * len(copying)
    assert resumed is not None and scheduler.draft_controller.pays(1) is True
