"""The "fair" policy (VTC across tenants) and deadlines, on the scheduler with a fake runner.

Service is measured here from what the runner computed, independently of the scheduler's
own counters: each prompt token computed costs 1, each sampled token 2 (VTC's weights). The
VTC bound (Sheng et al., Theorem 4.4) for two backlogged tenants is 2U with
U = w_p * L_input + w_q * M, M the most tokens a running batch holds: here max_num_seqs
requests of PROMPT + OUTPUT tokens.
"""

from __future__ import annotations

import zlib

import pytest

from engine.core.fair import OUTPUT_WEIGHT, PROMPT_WEIGHT, TenantCounters
from engine.request import RequestStatus
from tests.engine.core.core_testing import (
    FakeRunner,
    check_invariants,
    make_request,
    make_scheduler,
    reference_generate,
    run_until_done,
    step,
)

PROMPT, OUTPUT, SEATS = 16, 8, 2
U = PROMPT_WEIGHT * PROMPT + OUTPUT_WEIGHT * SEATS * (PROMPT + OUTPUT)


def _prompt(tenant: str, i: int) -> list[int]:
    # Distinct prompts: no prefix hits, so every prompt token is computed.
    seed = zlib.crc32(f"{tenant}/{i}".encode())
    return [(seed >> (j % 24) ^ j * 7) % 90 + 1 for j in range(PROMPT)]


def _submit(sched, tenant: str, count: int, weight: float = 1.0, start: int = 0) -> None:
    for i in range(start, start + count):
        sched.add_request(
            make_request(
                f"{tenant}-{i}",
                _prompt(tenant, i),
                OUTPUT,
                tenant=tenant,
                tenant_weight=weight,
                arrival_time=float(i),
            )
        )


def _backlogged(sched, tenant: str) -> bool:
    return any(r.tenant == tenant for r in sched.waiting)


def _serve(sched, runner, steps: int | None = None, while_backlogged=()) -> dict[str, float]:
    """Step; the service each tenant got. Stops after `steps`, or as soon as one of
    `while_backlogged` has nothing waiting."""
    service: dict[str, float] = {}
    n = 0
    while sched.has_unfinished_requests() and (steps is None or n < steps):
        if while_backlogged and not all(_backlogged(sched, t) for t in while_backlogged):
            break
        out, updates = step(sched, runner)
        for sr in out.scheduled:
            tenant = sr.request_id.split("-")[0]
            prompt_part = max(0, min(sr.start_pos + sr.num_tokens, PROMPT) - sr.start_pos)
            service[tenant] = service.get(tenant, 0.0) + PROMPT_WEIGHT * prompt_part
        for u in updates:
            tenant = u.request_id.split("-")[0]
            service[tenant] = service.get(tenant, 0.0) + OUTPUT_WEIGHT * len(u.new_token_ids)
        check_invariants(sched)
        n += 1
    return service


def test_equal_weights_ten_times_the_load_get_service_within_the_bound():
    results = {}
    for policy in ("fcfs", "fair"):
        sched = make_scheduler(num_blocks=64, max_num_seqs=SEATS, policy=policy)
        runner = FakeRunner(64, 16)
        _submit(sched, "heavy", 200)  # ten times the light tenant's load, and first
        _submit(sched, "light", 20)
        results[policy] = _serve(sched, runner, while_backlogged=("heavy", "light"))
    fair, fcfs = results["fair"], results["fcfs"]
    assert fair["light"] > 4 * U  # a long window, not a few steps
    assert abs(fair["heavy"] - fair["light"]) <= 2 * U
    # The same workload under FCFS: the light tenant waits behind all of the heavy one's.
    assert fcfs.get("light", 0.0) == 0 and fcfs["heavy"] > 2 * U


def test_weights_two_to_one_give_two_to_one():
    sched = make_scheduler(num_blocks=64, max_num_seqs=SEATS, policy="fair")
    runner = FakeRunner(64, 16)
    _submit(sched, "gold", 100, weight=2.0)
    _submit(sched, "plain", 100, weight=1.0)
    service = _serve(sched, runner, while_backlogged=("gold", "plain"))
    assert service["plain"] > 10 * U
    assert abs(service["gold"] / 2 - service["plain"]) <= 2 * U
    assert 1.7 < service["gold"] / service["plain"] < 2.3


def test_a_returning_idle_tenant_gets_no_credit_beyond_the_bound():
    sched = make_scheduler(num_blocks=64, max_num_seqs=SEATS, policy="fair")
    runner = FakeRunner(64, 16)
    _submit(sched, "busy", 300)
    alone = _serve(sched, runner, steps=400)  # "idle" asks for nothing meanwhile
    assert alone["busy"] > 10 * U
    _submit(sched, "idle", 100, start=1000)
    counters = sched.tenant_counters
    assert counters.counter("idle") == counters.counter("busy")  # lifted to the floor
    service = _serve(sched, runner, while_backlogged=("busy", "idle"))
    assert service["idle"] > 10 * U
    # Without the lift "idle" would take everything until it had caught up 10 U.
    assert abs(service["busy"] - service["idle"]) <= 2 * U


def test_a_tenant_over_its_share_keeps_its_debt_after_idling():
    counters = TenantCounters()
    counters.on_waiting("a", 1.0)
    counters.charge("a", prompt_tokens=1000)
    counters.on_unwaiting("a")  # a leaves ahead by 1000
    counters.on_waiting("b", 1.0)  # b lifted to a (the tenant that left last)
    assert counters.counter("b") == 1000
    counters.charge("b", output_tokens=10)  # b: 1020
    counters.on_waiting("a", 1.0)  # a returns below b's floor... it is lifted to b
    assert counters.counter("a") == 1020
    counters.charge("a", prompt_tokens=500, output_tokens=0)
    counters.on_unwaiting("a")
    counters.on_waiting("a", 1.0)  # a over the floor: keeps its 1520, no reset by idling
    assert counters.counter("a") == 1520


def test_tenant_weight_divides_the_charge_and_the_latest_wins():
    counters = TenantCounters()
    counters.on_waiting("t", 4.0)
    counters.charge("t", prompt_tokens=4, output_tokens=2)  # (4 + 4) / 4
    assert counters.counter("t") == 2.0
    counters.on_waiting("t", 0.5)
    counters.charge("t", output_tokens=1)
    assert counters.counter("t") == 6.0


def test_priority_class_comes_before_the_counters():
    sched = make_scheduler(max_num_seqs=1, policy="fair")
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("a-1", [1, 2], 1, tenant="a", arrival_time=1.0))
    step(sched, runner)  # a has been served, b not
    sched.add_request(make_request("b-1", [3], 1, tenant="b", priority=1, arrival_time=2.0))
    sched.add_request(make_request("a-2", [4], 1, tenant="a", priority=0, arrival_time=3.0))
    order = [step(sched, runner)[0].scheduled[0].request_id for _ in range(2)]
    assert order == ["a-2", "b-1"]


def test_preemption_takes_the_newest_request_of_the_tenant_most_over_its_share():
    sched = make_scheduler(num_blocks=7, policy="fair")  # 6 usable blocks
    runner = FakeRunner(7, 16)
    prompts = {
        "hog-old": list(range(20)),  # 2 blocks
        "x-1": list(range(100, 132)),  # 2 blocks, a third for its first output token
        "hog-new": list(range(200, 210)),  # 1 block
        "small-1": list(range(50, 60)),  # 1 block
    }
    for t, (rid, prompt) in enumerate(prompts.items()):
        tenant = rid.split("-")[0]
        sched.add_request(make_request(rid, prompt, 20, tenant=tenant, arrival_time=float(t)))
    out, _ = step(sched, runner)
    assert sorted(s.request_id for s in out.scheduled) == sorted(prompts)
    assert sched.kv_cache_manager.num_free_blocks == 0
    # hog is over its share (as if served while the others waited). small-1 is the newest
    # request, FCFS's victim; fair takes hog's newest.
    sched.tenant_counters.charge("hog", prompt_tokens=1000)
    out, _ = step(sched, runner)
    assert out.preempted_request_ids == ["hog-new"]
    check_invariants(sched)
    transcript = run_until_done(sched, runner, check=True)
    assert transcript.tokens["x-1"] == reference_generate(prompts["x-1"], 20)[2:]
    assert transcript.tokens["hog-new"] == reference_generate(prompts["hog-new"], 20)[1:]


def test_a_tenant_below_its_seat_share_takes_a_seat_from_one_above_it():
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, policy="fair")
    runner = FakeRunner(64, 16)
    _submit(sched, "heavy", 40)
    step(sched, runner)
    step(sched, runner)
    assert [r.tenant for r in sched.running] == ["heavy"] * 4
    sched.add_request(make_request("light-0", [7, 8, 9], 4, tenant="light", arrival_time=99.0))
    # Lifted to heavy's counter on arrival (a tie, which the shorter backlog wins): it takes
    # a seat at once, not when a heavy request ends.
    assert sched.tenant_counters.counter("light") == sched.tenant_counters.counter("heavy")
    out, _ = step(sched, runner)
    assert "light-0" in {s.request_id for s in out.scheduled}
    assert out.preempted_request_ids == ["heavy-3"]  # heavy's newest
    check_invariants(sched)


def test_a_request_preempted_for_a_seat_waits_for_the_next_step():
    # heavy holds every seat with nothing waiting; light arrives with two requests, tied on
    # the counter. heavy's newest gives light a seat and is then the head of the queue
    # (a tie, and its backlog is the shorter): it must not take a seat back in the same step
    # (which handed back its undone chunk's budget, and the two swapped the seat forever).
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, policy="fair")
    runner = FakeRunner(64, 16)
    _submit(sched, "heavy", 4)
    step(sched, runner)
    assert [r.tenant for r in sched.running] == ["heavy"] * 4 and not sched.waiting
    for i in range(2):
        sched.add_request(make_request(f"light-{i}", [7, 8, 9 + i], 4, tenant="light"))
    out, _ = step(sched, runner)
    scheduled = {s.request_id for s in out.scheduled}
    assert out.preempted_request_ids and not scheduled & set(out.preempted_request_ids)
    assert "light-0" in scheduled
    check_invariants(sched)
    run_until_done(sched, runner)
    check_invariants(sched)


def test_seat_shares_do_not_make_equal_tenants_trade_seats():
    sched = make_scheduler(num_blocks=64, max_num_seqs=4, policy="fair")
    runner = FakeRunner(64, 16)
    _submit(sched, "a", 60)
    _submit(sched, "b", 60)
    _serve(sched, runner)
    # Seats move only toward the shares: a few preemptions while they settle, not one per
    # request (120) or per step.
    assert sched.num_preemptions <= 4


def test_fair_without_tenants_is_one_shared_fifo():
    sched = make_scheduler(max_num_seqs=1, policy="fair")
    runner = FakeRunner(64, 16)
    for i, rid in enumerate(["p", "q", "r"]):
        sched.add_request(make_request(rid, [i + 1], 1, arrival_time=float(i)))
    order = [step(sched, runner)[0].scheduled[0].request_id for _ in range(3)]
    assert order == ["p", "q", "r"]


def test_per_tenant_prefix_hits_are_counted_under_any_policy():
    sched = make_scheduler(policy="fcfs")
    runner = FakeRunner(64, 16)
    prompt = list(range(1, 40))
    sched.add_request(make_request("a-1", prompt, 2, tenant="a"))
    run_until_done(sched, runner)
    sched.add_request(make_request("a-2", prompt, 2, tenant="a"))
    sched.add_request(make_request("anon", [5, 6], 2))
    run_until_done(sched, runner)
    assert sched.stats().tenants == {"a": (78, 32, 4)}  # two full blocks hit the second time


# -- deadlines ---------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_expired_requests_running_or_waiting_are_returned_once_and_free_their_blocks(policy):
    sched = make_scheduler(num_blocks=16, max_num_seqs=1, policy=policy)
    runner = FakeRunner(16, 16)
    free = sched.kv_cache_manager.num_free_blocks
    sched.add_request(make_request("run", list(range(40)), 50, deadline=10.0, tenant="a"))
    sched.add_request(make_request("wait", list(range(5)), 50, deadline=20.0, tenant="b"))
    sched.add_request(make_request("none", list(range(5)), 2))
    step(sched, runner)
    assert sched.expired_requests(9.9) == []
    assert sched.expired_requests(10.0) == ["run"]
    assert sched.expired_requests(15.0) == []  # once
    sched.finish_requests(["run"], RequestStatus.FINISHED_TIMEOUT)
    assert sched.get_request("run") is None
    assert sched.kv_cache_manager.num_free_blocks == free
    assert sched.expired_requests(25.0) == ["wait"]
    sched.finish_requests(["wait"], RequestStatus.FINISHED_TIMEOUT)
    check_invariants(sched)
    transcript = run_until_done(sched, runner, check=True)
    assert transcript.finish == {"none": "length"}
    assert sched.kv_cache_manager.num_free_blocks == free


def test_a_finished_request_never_expires_and_a_reused_id_keeps_its_own_deadline():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("r", [1, 2, 3], 1, deadline=5.0))
    run_until_done(sched, runner)
    sched.add_request(make_request("r", [1, 2, 3], 4, deadline=50.0))
    assert sched.expired_requests(10.0) == []
    assert sched.expired_requests(50.0) == ["r"]


def test_a_timeout_ends_the_forked_samples_too():
    sched = make_scheduler()
    runner = FakeRunner(64, 16)
    sched.add_request(make_request("p", list(range(20)), 30, n=3, seed=1, deadline=7.0))
    step(sched, runner)
    step(sched, runner)  # forked
    assert {"p", "p#1", "p#2"} <= set(sched.requests)
    assert sched.expired_requests(8.0) == ["p"]
    sched.finish_requests(["p"], RequestStatus.FINISHED_TIMEOUT)
    assert not sched.requests
    check_invariants(sched)
    assert sched.kv_cache_manager.num_free_blocks == 63
