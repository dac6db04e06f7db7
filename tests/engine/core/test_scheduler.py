"""Scheduler decisions step by step, with hand-made ModelRunnerOutputs or the paged FakeRunner
(which checks every block table against the tokens it must hold)."""

from __future__ import annotations

import pytest
from core_testing import (
    FakeRunner,
    Transcript,
    check_invariants,
    make_request,
    make_scheduler,
    reference_generate,
    run_until_done,
    step,
)

from engine.config import CacheConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.outputs import ModelRunnerOutput, TokenLogprobs
from engine.request import RequestStatus

ABORT = RequestStatus.FINISHED_ABORTED


def shape(out):
    """(request id, start position, number of tokens, sample) per scheduled request."""
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in out.scheduled]


# -- chunked prefill and the token budget ----------------------------------------------------


def test_chunked_prefill_of_a_prompt_longer_than_the_budget():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(64, 16)
    prompt = list(range(150))
    sched.add_request(make_request("r", prompt, max_tokens=3))

    out, updates = step(sched, runner)
    assert shape(out) == [("r", 0, 64, False)] and out.num_batched_tokens == 64
    assert [n.request_id for n in out.new_requests] == ["r"]
    assert out.new_requests[0].prompt_token_ids == prompt and runner.step_tokens["r"] == prompt[:64]
    assert out.scheduled[0].new_block_ids == [1, 2, 3, 4] and updates == []
    assert runner.block_table("r") == [1, 2, 3, 4]

    # Later chunks carry only the blocks added since: the runner's table grows in place.
    out, updates = step(sched, runner)
    assert shape(out) == [("r", 64, 64, False)] and updates == [] and out.new_requests == []
    assert (
        out.scheduled[0].new_block_ids == [5, 6, 7, 8] and runner.step_tokens["r"] == prompt[64:128]
    )
    assert runner.block_table("r") == list(range(1, 9))

    out, updates = step(sched, runner)
    assert shape(out) == [("r", 128, 22, True)] and out.scheduled[0].new_block_ids == [9, 10]
    assert runner.block_table("r") == list(range(1, 11))
    assert [u.new_token_ids for u in updates] == [reference_generate(prompt, 1)]

    out, _ = step(sched, runner)
    assert shape(out) == [("r", 150, 1, True)] and out.scheduled[0].new_block_ids == []
    assert runner.step_tokens["r"] == reference_generate(prompt, 1)
    transcript = run_until_done(sched, runner)
    assert transcript.finish == {"r": "length"}


def test_decode_is_scheduled_before_new_prefills():
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a", list(range(20)), max_tokens=10))
    assert shape(step(sched, runner)[0]) == [("a", 0, 20, True)]
    sched.add_request(make_request("b", list(range(100, 200)), max_tokens=2))
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 20, 1, True), ("b", 0, 31, False)]
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 21, 1, True), ("b", 31, 31, False)]
    assert sched.num_running == 2 and sched.num_waiting == 0


def test_without_chunked_prefill_a_prompt_waits_for_room_in_the_budget():
    sched = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a", list(range(40)), max_tokens=10))
    step(sched, runner)
    sched.add_request(make_request("b", list(range(100, 140)), max_tokens=10))
    sched.add_request(make_request("c", list(range(200, 230)), max_tokens=10))
    out, _ = step(sched, runner)
    # b's 40 tokens fit after a's decode token; c's 30 do not fit the 23 left and are not split.
    assert shape(out) == [("a", 40, 1, True), ("b", 0, 40, True)]
    assert sched.num_waiting == 1
    out, _ = step(sched, runner)
    assert shape(out) == [("a", 41, 1, True), ("b", 40, 1, True), ("c", 0, 30, True)]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(64, 16)
    for rid in "abc":
        sched.add_request(make_request(rid, [1, 2, 3], max_tokens=2))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and sched.num_waiting == 1
    out, _ = step(sched, runner)  # a and b finish here
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["c"]
    assert out.finished_request_ids == ["a", "b"]


# -- preemption ---------------------------------------------------------------------------


def test_preemption_under_a_tiny_pool_and_the_same_tokens_after_recompute():
    sched = make_scheduler(num_blocks=5)  # 4 usable blocks of 16
    runner = FakeRunner(5, 16)
    pa, pb = list(range(30)), list(range(50, 80))
    a, b = make_request("a", pa, max_tokens=20), make_request("b", pb, max_tokens=20)
    sched.add_request(a)
    sched.add_request(b)
    transcript = Transcript()
    for _ in range(3):  # prefill, then two decodes: both fill their two blocks
        out, _ = step(sched, runner, transcript)
        assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched, runner, transcript)
    # a needs a third block: b, the newest, is preempted and its blocks go to a.
    assert out.preempted_request_ids == ["b"]
    assert shape(out) == [("a", 32, 1, True)]
    assert out.scheduled[0].new_block_ids == [4] and runner.block_table("a") == [1, 2, 4]
    assert "b" not in runner.batch  # the runner dropped the preempted request
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["b"]
    assert sched.stats().num_preemptions == 1 and b.num_preemptions == 1
    check_invariants(sched)

    transcript2 = run_until_done(sched, runner, check=True)
    for rid, toks in transcript2.tokens.items():
        transcript.tokens.setdefault(rid, []).extend(toks)
    assert transcript.tokens["a"] == reference_generate(pa, 20)
    assert transcript.tokens["b"] == reference_generate(pb, 20)
    assert transcript2.finish == {"a": "length", "b": "length"}
    assert b.num_cached_tokens == 0  # the first lookup's value, not the recompute's


def test_preempted_request_is_recomputed_from_its_own_cached_blocks():
    sched = make_scheduler(num_blocks=7)  # 6 usable
    runner = FakeRunner(7, 16)
    pa, pb = list(range(47)), list(range(100, 131))
    sched.add_request(make_request("a", pa, max_tokens=3))
    sched.add_request(make_request("b", pb, max_tokens=10))
    transcript = Transcript()
    step(sched, runner, transcript)  # a: 3 blocks, b: 2 blocks, 1 free
    step(sched, runner, transcript)
    out, _ = step(sched, runner, transcript)
    # a takes the last free block; b needs a third block, and is itself the newest: out.
    assert out.preempted_request_ids == ["b"] and shape(out) == [("a", 48, 1, True)]
    assert transcript.finish == {"a": "length"}
    out, _ = step(sched, runner, transcript)
    # b's two full blocks were computed and cached before it was preempted: 32 of 33 hit.
    assert shape(out) == [("b", 32, 1, True)]
    # b is new again for the runner: prompt, and its outputs so far, recomputed from a hit.
    [new] = out.new_requests
    assert new.request_id == "b" and new.prompt_token_ids == pb
    assert new.output_token_ids == transcript.tokens["b"][:2] and len(transcript.tokens["b"]) == 3
    assert out.scheduled[0].new_block_ids == [4, 5, 6] and runner.block_table("b") == [4, 5, 6]
    rest = run_until_done(sched, runner, check=True)
    assert transcript.tokens["a"] == reference_generate(pa, 3)
    assert transcript.tokens["b"] + rest.tokens["b"] == reference_generate(pb, 10)
    stats = sched.stats()  # the recompute's lookup is not a new query
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (47 + 31, 0)


@pytest.mark.parametrize("policy, victim", [("fcfs", "z"), ("priority", "y")])
def test_preemption_victim_by_policy(policy, victim):
    sched = make_scheduler(num_blocks=7, policy=policy)  # 6 usable
    runner = FakeRunner(7, 16)
    sched.add_request(make_request("y", list(range(20)), priority=5, arrival_time=1.0))
    step(sched, runner)
    sched.add_request(make_request("x", list(range(100, 132)), priority=0, arrival_time=2.0))
    sched.add_request(make_request("z", list(range(200, 220)), priority=1, arrival_time=3.0))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["y", "x", "z"]
    assert sched.kv_cache_manager.num_free_blocks == 0
    out, _ = step(sched, runner)  # x (33 tokens) needs a third block
    assert out.preempted_request_ids == [victim]
    # Under "priority" the victim (y) had already been scheduled this step: it is taken back.
    assert [s.request_id for s in out.scheduled] == [r for r in "yxz" if r != victim]
    assert out.num_batched_tokens == 2
    check_invariants(sched)
    run_until_done(sched, runner, check=True)


def test_priority_policy_admits_in_priority_then_arrival_order():
    sched = make_scheduler(policy="priority", max_num_seqs=1)
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("late-urgent", [1], priority=0, arrival_time=3.0, max_tokens=1))
    sched.add_request(make_request("early-low", [1], priority=2, arrival_time=1.0, max_tokens=1))
    sched.add_request(make_request("early-urgent", [1], priority=0, arrival_time=2.0, max_tokens=1))
    order = [step(sched, runner)[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["early-urgent", "late-urgent", "early-low"]


# -- abort / finish from every state --------------------------------------------------------


def test_abort_waiting_request():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a", list(range(10))))
    sched.add_request(make_request("b", list(range(10))))
    step(sched, runner)
    sched.finish_requests(["b"], ABORT)
    assert sched.num_waiting == 0 and sched.get_request("b") is None
    out, _ = step(sched, runner)
    assert out.finished_request_ids == ["b"] and shape(out) == [("a", 10, 1, True)]
    check_invariants(sched)


def test_abort_mid_prefill_and_running_free_blocks_at_once():
    sched = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(64, 16)
    manager = sched.kv_cache_manager
    sched.add_request(make_request("long", list(range(100))))
    sched.add_request(make_request("short", list(range(5))))
    out, _ = step(sched, runner)
    assert shape(out) == [("long", 0, 32, False)]
    sched.finish_requests("long", ABORT)  # mid-prefill
    assert manager.num_free_blocks == 63 and sched.num_running == 0
    out, _ = step(sched, runner)
    assert out.finished_request_ids == ["long"] and shape(out) == [("short", 0, 5, True)]
    sched.finish_requests(["short"], ABORT)  # decoding
    assert manager.num_free_blocks == 63 and not sched.has_unfinished_requests()
    assert sched.schedule().finished_request_ids == ["short"]
    check_invariants(sched)


def test_abort_preempted_request():
    sched = make_scheduler(num_blocks=5)
    runner = FakeRunner(5, 16)
    sched.add_request(make_request("a", list(range(30)), max_tokens=20))
    sched.add_request(make_request("b", list(range(50, 80)), max_tokens=20))
    for _ in range(4):
        out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["b"]
    sched.finish_requests(["b"], ABORT)
    assert sched.num_waiting == 0 and sched.get_request("b") is None
    check_invariants(sched)
    transcript = run_until_done(sched, runner, check=True)
    assert transcript.finish == {"a": "length"}


def test_abort_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a", list(range(10))))
    sched.add_request(make_request("b", list(range(10))))
    out = sched.schedule()
    result = runner(out)
    sched.finish_requests(["a"], ABORT)
    updates = sched.update_from_output(out, result)
    assert [u.request_id for u in updates] == ["b"]
    check_invariants(sched)


def test_finish_ignores_unknown_and_finished_ids_and_checks_status():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a", [1, 2], max_tokens=1))
    transcript = run_until_done(sched, runner)
    assert transcript.finish == {"a": "length"}
    sched.finish_requests(["a", "nope"], ABORT)
    assert sched.schedule().finished_request_ids == ["a"]  # from the finish, not the abort
    with pytest.raises(ValueError, match="finished status"):
        sched.finish_requests(["a"], RequestStatus.RUNNING)


def test_finish_stopped_by_the_engine():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    req = make_request("a", [1, 2, 3], max_tokens=10)
    sched.add_request(req)
    step(sched, runner)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)  # e.g. a stop string
    assert req.status == RequestStatus.FINISHED_STOPPED and req.finish_reason == "stop"
    assert sched.kv_cache_manager.num_free_blocks == 63


# -- stop conditions -----------------------------------------------------------------------


def drive(sched: Scheduler, rid: str, tokens: list[int]):
    """Feed the request these sampled tokens one step at a time; return the last update."""
    for token in tokens:
        out = sched.schedule()
        assert [s.request_id for s in out.scheduled] == [rid]
        [update] = sched.update_from_output(out, ModelRunnerOutput({rid: [token]}))
        if update.finish_reason is not None:
            return update
    return update


@pytest.mark.parametrize(
    "params, tokens, num_out, reason, stop_reason",
    [
        (dict(eos_token_id=5), [1, 2, 5, 1], 3, "stop", None),
        (dict(eos_token_id=5, ignore_eos=True, max_tokens=4), [5, 5, 5, 5], 4, "length", None),
        (dict(eos_token_id=5, min_tokens=3), [5, 5, 5, 1], 3, "stop", None),
        (dict(eos_token_id=5, min_tokens=2), [1, 5, 1], 2, "stop", None),
        (dict(stop_token_ids=[7, 8]), [1, 8, 1], 2, "stop", 8),
        (dict(stop_token_ids=[7], min_tokens=3), [7, 7, 7, 1], 3, "stop", 7),
        (dict(max_tokens=2), [1, 2, 3], 2, "length", None),
        # A stop token on the last allowed token: the model stopped, so "stop" wins.
        (dict(eos_token_id=5, max_tokens=2), [1, 5, 1], 2, "stop", None),
        (dict(max_tokens=None), [1] * 10, 4, "length", None),  # max_model_len = 20, prompt 16
    ],
)
def test_stop_conditions(params, tokens, num_out, reason, stop_reason):
    sched = make_scheduler(max_model_len=20, max_num_batched_tokens=32)
    max_tokens = params.pop("max_tokens", 16)
    req = make_request("r", list(range(16)), max_tokens=max_tokens, **params)
    sched.add_request(req)
    update = drive(sched, "r", tokens)
    assert update.finish_reason == reason and update.stop_reason == stop_reason
    assert req.output_token_ids == tokens[:num_out]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 63
    assert sched.schedule().finished_request_ids == ["r"]


def test_logprobs_are_passed_through():
    sched = make_scheduler()
    sched.add_request(make_request("r", [1, 2, 3], max_tokens=2, logprobs=1))
    out = sched.schedule()
    lp = [TokenLogprobs(token_id=9, logprob=-0.5, rank=1, top=[(9, -0.5)])]
    [update] = sched.update_from_output(out, ModelRunnerOutput({"r": [9]}, {"r": lp}))
    assert update.new_logprobs == lp and update.new_token_ids == [9]


# -- n > 1: forked samples -------------------------------------------------------------------


def test_fork_shares_the_prompt_and_copies_the_partial_block():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    prompt = list(range(20))  # one full block + 4 tokens
    sched.add_request(make_request("r", prompt, max_tokens=5, n=3, seed=10))
    transcript = Transcript()
    out, updates = step(sched, runner, transcript)
    [sr] = out.scheduled
    assert sr.num_samples == 3 and sr.sample and sr.new_block_ids == [1, 2]
    assert runner.block_table("r") == [1, 2]
    assert [(u.request_id, u.parent_id, u.sample_index) for u in updates] == [
        ("r#1", "r", 1),
        ("r#2", "r", 2),
        ("r", None, 0),
    ]
    assert [u.new_token_ids for u in updates] == [
        [reference_generate(prompt, 1, sample_index=i)[0]] for i in (1, 2, 0)
    ]
    assert [sched.get_request(f"r#{i}").sampling_params.seed for i in (1, 2)] == [11, 12]
    assert sched.get_request("r#1").sampling_params.n == 1
    blocks = sched.kv_cache_manager.block_pool.blocks
    assert [blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [3, 1, 1, 1]
    check_invariants(sched)

    out, _ = step(sched, runner, transcript)
    assert out.blocks_to_copy == [(2, 3), (2, 4)]
    table = runner.block_table
    assert [(s.request_id, table(s.request_id), s.num_samples) for s in out.scheduled] == [
        ("r", [1, 2], 1),
        ("r#1", [1, 3], 1),
        ("r#2", [1, 4], 1),
    ]
    # The samples reach the runner once, as new requests with the prompt and their first token.
    assert [s.new_block_ids for s in out.scheduled] == [[], [1, 3], [1, 4]]
    assert [(n.request_id, n.prompt_token_ids, n.output_token_ids) for n in out.new_requests] == [
        (f"r#{i}", prompt, [reference_generate(prompt, 1, sample_index=i)[0]]) for i in (1, 2)
    ]
    assert [n.sampling_params.seed for n in out.new_requests] == [11, 12]
    rest = run_until_done(sched, runner, check=True)
    assert sched.schedule().blocks_to_copy == []
    for i, rid in enumerate(["r", "r#1", "r#2"]):
        tokens = transcript.tokens[rid] + rest.tokens[rid]
        assert tokens == reference_generate(prompt, 5, sample_index=i)
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_fork_at_a_block_boundary_copies_nothing():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("r", list(range(32)), max_tokens=3, n=2))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.blocks_to_copy == []
    assert [runner.block_table(s.request_id) for s in out.scheduled] == [[1, 2, 3], [1, 2, 4]]


def test_fork_without_a_free_block_recomputes_the_child():
    sched = make_scheduler(num_blocks=3)  # 2 usable: the parent's prompt takes both
    runner = FakeRunner(3, 16)
    prompt = list(range(20))
    sched.add_request(make_request("r", prompt, max_tokens=5, n=2))
    _, updates = step(sched, runner)
    assert {u.request_id for u in updates} == {"r", "r#1"}
    child = sched.get_request("r#1")
    assert child.status == RequestStatus.WAITING and sched.num_waiting == 1
    transcript = run_until_done(sched, runner, check=True)
    first = {u.request_id: u.new_token_ids for u in updates}
    for i, rid in enumerate(["r", "r#1"]):
        assert first[rid] + transcript.tokens[rid] == reference_generate(prompt, 5, sample_index=i)


def test_n_reserves_seats_for_its_samples():
    sched = make_scheduler(max_num_seqs=3)
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("p", list(range(10)), max_tokens=3, n=3))
    sched.add_request(make_request("q", list(range(10)), max_tokens=3))
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["p"]
    out, _ = step(sched, runner)
    assert [s.request_id for s in out.scheduled] == ["p", "p#1", "p#2"]
    transcript = run_until_done(sched, runner, check=True)
    assert set(transcript.finish) == {"p", "p#1", "p#2", "q"}


def test_samples_that_finish_on_their_first_token():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("r", list(range(20)), max_tokens=1, n=3))
    _, updates = step(sched, runner)
    assert sorted((u.request_id, u.finish_reason) for u in updates) == [
        ("r", "length"),
        ("r#1", "length"),
        ("r#2", "length"),
    ]
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_aborting_a_parent_aborts_its_samples():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("r", list(range(20)), max_tokens=5, n=3))
    step(sched, runner)
    assert sched.num_running == 3
    sched.finish_requests(["r"], ABORT)
    assert not sched.has_unfinished_requests()
    assert sorted(sched.schedule().finished_request_ids) == ["r", "r#1", "r#2"]
    assert sched.kv_cache_manager.num_free_blocks == 63


# -- prefix caching, stats, validation -------------------------------------------------------


def test_prefix_cache_hits_are_counted_once_per_request():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    shared = list(range(32))
    sched.add_request(make_request("a", [*shared, 1, 2, 3, 4, 5, 6, 7, 8], max_tokens=2))
    run_until_done(sched, runner)
    sched.add_request(make_request("b", [*shared, 9, 9, 9], max_tokens=2))
    out, updates = step(sched, runner)
    assert shape(out) == [("b", 32, 3, True)]
    assert updates[0].num_cached_tokens == 32
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 35, 32)
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (1, 0, 0)
    assert stats.kv_usage == pytest.approx(3 / 63)


def test_only_blocks_with_computed_kv_are_cached():
    """A finished request's last sampled token never gets K/V: a block it completes must not
    become a prefix hit (its last slot was never written)."""
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    prompt = list(range(15))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    transcript = run_until_done(sched, runner)
    full_block = prompt + transcript.tokens["a"]
    assert len(full_block) == 16
    assert sched.kv_cache_manager.block_pool.cached_block_hash_to_block == {}
    sched.add_request(make_request("b", [*full_block, 1, 2], max_tokens=2))
    out, _ = step(sched, runner)
    assert shape(out) == [("b", 0, 18, True)]  # no hit: all 18 computed
    run_until_done(sched, runner)
    # b computed those 16 tokens itself: now they are a hit.
    sched.add_request(make_request("c", [*full_block, 5], max_tokens=1))
    assert shape(step(sched, runner)[0]) == [("c", 16, 1, True)]


def test_an_aborted_prefill_caches_only_the_chunks_it_computed():
    sched = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(64, 16)
    prompt = list(range(100))
    sched.add_request(make_request("a", prompt))
    assert shape(step(sched, runner)[0]) == [("a", 0, 64, False)]
    sched.finish_requests(["a"], ABORT)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    out, _ = step(sched, runner)
    assert shape(out) == [("b", 64, 36, True)]  # 4 computed blocks hit, not 6 known ones
    assert run_until_done(sched, runner).tokens["b"] == reference_generate(prompt, 2)[1:]


def test_add_request_validation():
    sched = make_scheduler(max_model_len=32)
    sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="empty prompt"):
        sched.add_request(make_request("e", []))
    with pytest.raises(ValueError, match="more than max_model_len"):
        sched.add_request(make_request("l", list(range(33))))
    with pytest.raises(ValueError, match="exceed max_num_seqs"):
        make_scheduler(max_num_seqs=2).add_request(make_request("n", [1], n=3))
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=16), CacheConfig(block_size=32), 200)
    with pytest.raises(ValueError, match="cannot hold one sequence of max_model_len"):
        Scheduler(SchedulerConfig(max_model_len=65), CacheConfig(), 5)
    Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(), 5)
