"""Property test: random add / step / abort / stop sequences against a small pool.

After every operation the block and request bookkeeping must be consistent
(core_testing.check_invariants); the FakeRunner checks every step that each block table
reads back exactly the request's tokens, and that the runner's input batch, fed only the
incremental SchedulerOutputs, holds the scheduler's tokens and block tables; at the end every request has finished or been
aborted, and every sample's tokens are a prefix of what the fake model generates for it
alone (preemption, prefix hits and forks never change a token).

With async scheduling the driver runs the engine's loop: each step is scheduled before the
previous one's output is applied (on placeholders), except after a step that forks samples
(engine.async_scheduling.needs_sync); the fake runner is then one token ahead of the scheduler.
"""

from __future__ import annotations

import pytest
from core_testing import (
    FakeRunner,
    Transcript,
    check_invariants,
    check_runner_state,
    make_request,
    make_scheduler,
    reference_generate,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.async_scheduling import needs_sync
from engine.request import RequestStatus

EOS = 3
BASES = [list(range(40 * k + 5, 40 * k + 45)) for k in range(3)]  # shared prompt prefixes

add_op = st.tuples(
    st.just("add"),
    st.integers(0, len(BASES) - 1),  # which shared prefix
    st.integers(0, 40),  # how much of it
    st.lists(st.integers(0, 96), max_size=40),  # own suffix
    st.integers(1, 3),  # n
    st.integers(1, 24),  # max_tokens
    st.integers(0, 2),  # priority
    st.sampled_from([None, None, "tenant"]),  # cache_salt
    st.booleans(),  # stop on EOS
)
ops = st.lists(
    st.one_of(
        add_op,
        add_op,
        st.just(("step",)),
        st.just(("step",)),
        st.just(("step",)),
        st.tuples(st.sampled_from(["abort", "stop", "abort_mid_step"]), st.integers(0, 1000)),
    ),
    min_size=15,
    max_size=80,
)
configs = st.fixed_dictionaries(
    {
        "block_size": st.sampled_from([8, 16]),
        "extra_blocks": st.integers(0, 6),
        "max_num_batched_tokens": st.sampled_from([16, 24, 64]),
        "max_num_seqs": st.integers(3, 6),
        "policy": st.sampled_from(["fcfs", "priority", "fair"]),
        "enable_chunked_prefill": st.booleans(),
        "enable_prefix_caching": st.booleans(),
    }
)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(config=configs, operations=ops)
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_random_workloads_keep_the_books_straight(config, operations, async_scheduling):
    bs = config["block_size"]
    budget = config["max_num_batched_tokens"]
    chunked = config["enable_chunked_prefill"]
    max_model_len = 96 if chunked else 64
    if not chunked:
        budget = max(budget, max_model_len)
    num_blocks = -(-max_model_len // bs) + 1 + config["extra_blocks"]  # room for one sequence
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=bs,
        max_num_batched_tokens=budget,
        max_num_seqs=config["max_num_seqs"],
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=config["enable_prefix_caching"],
        policy=config["policy"],
    )
    sched.async_scheduling = async_scheduling  # what the engine's resolved option sets
    runner = FakeRunner(num_blocks, bs)
    in_flight = []  # async scheduling: the step whose output is not applied yet
    transcript = Transcript()
    specs: dict[str, dict] = {}  # user request id -> what it asked for
    ended: set[str] = set()  # every scheduler request id (samples included) that ended
    clock = 0.0

    def live_ids() -> list[str]:
        return sorted(sched.requests)

    def finish(rid: str, status: RequestStatus) -> None:
        """Finish rid as the engine would, and note which sample ids that ends."""
        request = sched.get_request(rid)
        samples = {rid}
        if rid in specs and (
            status == RequestStatus.FINISHED_ABORTED or not request.output_token_ids
        ):
            # Aborting a parent aborts its samples; finishing one before it forked them
            # means they never exist.
            samples |= {f"{rid}#{i}" for i in range(1, specs[rid]["n"])}
        sched.finish_requests([rid], status)
        ended.update(samples)

    def do_step(abort_index: int | None = None) -> None:
        if in_flight and needs_sync(in_flight[0][0], sched.requests):
            transcript.add(sched.update_from_output(*in_flight.pop()))
        out = sched.schedule()
        result = runner(out)
        if abort_index is not None and sched.requests:  # an abort while the step runs
            finish(live_ids()[abort_index % len(sched.requests)], RequestStatus.FINISHED_ABORTED)
        if not async_scheduling:
            transcript.add(sched.update_from_output(out, result))
            check_runner_state(sched, runner)
            return
        if in_flight:
            transcript.add(sched.update_from_output(*in_flight.pop()))
        in_flight.append((out, result))

    for op in operations:
        kind = op[0]
        if kind == "add":
            _, base, plen, suffix, n, max_tokens, priority, salt, use_eos = op
            prompt = (BASES[base][:plen] + suffix)[: max_model_len - 1] or [1]
            rid = f"r{len(specs)}"
            clock += 1.0
            params = dict(n=n, priority=priority, arrival_time=clock, cache_salt=salt)
            params["tenant"] = salt  # "fair": the salt's owner is the tenant (None: shared)
            eos = EOS if use_eos else None
            sched.add_request(make_request(rid, prompt, max_tokens, eos_token_id=eos, **params))
            specs[rid] = dict(prompt=prompt, max_tokens=max_tokens, n=n, eos=eos)
        elif kind == "step":
            do_step()
        elif kind == "abort_mid_step":
            do_step(abort_index=op[1])
        elif sched.requests:
            rid = live_ids()[op[1] % len(sched.requests)]
            aborted = kind == "abort"
            finish(
                rid, RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
            )
        check_invariants(sched)

    for _ in range(3000):  # drain
        if not sched.has_unfinished_requests() and not in_flight:
            break
        do_step()
        check_invariants(sched)
    assert not sched.has_unfinished_requests(), "requests left behind"
    assert sched.kv_cache_manager.num_free_blocks == num_blocks - 1

    # No request lost: each sample of each request either finished (a RequestUpdate said so)
    # or was aborted/stopped by the driver.
    for rid, spec in specs.items():
        for i in range(spec["n"]):
            sid = rid if i == 0 else f"{rid}#{i}"
            assert sid in transcript.finish or sid in ended, f"{sid} was lost"
            got = transcript.tokens.get(sid, [])
            want = reference_generate(
                spec["prompt"], spec["max_tokens"], i, spec["eos"], max_model_len
            )
            if sid in transcript.finish:
                assert got == want, sid
            else:
                assert got == want[: len(got)], sid
    assert sched.stats().num_running == sched.stats().num_waiting == 0
