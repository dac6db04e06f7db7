"""The scheduler under async scheduling: a step is scheduled before the previous one's tokens
are applied, on placeholders (Request.num_output_placeholders)."""

from __future__ import annotations

from engine.outputs import ModelRunnerOutput
from engine.request import RequestStatus
from tests.engine.core.core_testing import make_request, make_scheduler


def _async_scheduler(**kwargs):
    scheduler = make_scheduler(**kwargs)
    scheduler.async_scheduling = True  # what the engine's resolved option sets
    return scheduler


def _out(**tokens) -> ModelRunnerOutput:
    return ModelRunnerOutput(sampled_token_ids={k: v for k, v in tokens.items()})


def test_schedules_ahead_on_a_placeholder_and_not_past_max_tokens():
    s = _async_scheduler(block_size=8, num_blocks=8)
    a = make_request("a", [1, 2, 3, 4, 5], max_tokens=3)
    s.add_request(a)
    first = s.schedule()
    assert [(r.start_pos, r.num_tokens, r.sample) for r in first.scheduled] == [(0, 5, True)]
    assert a.num_output_placeholders == 1
    second = s.schedule()  # before the first's token is back: the decode of its placeholder
    assert [(r.start_pos, r.num_tokens, r.sample) for r in second.scheduled] == [(5, 1, True)]
    assert a.num_output_placeholders == 2
    s.update_from_output(first, _out(a=[10]))
    assert a.output_token_ids == [10] and a.num_output_placeholders == 1
    third = s.schedule()
    assert [(r.start_pos, r.num_tokens) for r in third.scheduled] == [(6, 1)]
    s.update_from_output(second, _out(a=[11]))
    # Its third and last token is being sampled: nothing more to compute for it.
    assert s.schedule().is_empty
    (update,) = s.update_from_output(third, _out(a=[12]))
    assert update.finish_reason == "length" and a.output_token_ids == [10, 11, 12]
    assert s.kv_cache_manager.block_pool.num_free_blocks == 7


def test_a_token_after_the_request_stopped_is_dropped():
    s = _async_scheduler(block_size=8, num_blocks=8)
    a = make_request("a", [1, 2, 3], max_tokens=10, eos_token_id=9)
    s.add_request(a)
    first = s.schedule()
    second = s.schedule()
    (update,) = s.update_from_output(first, _out(a=[9]))  # EOS: done
    assert update.finish_reason == "stop" and s.get_request("a") is None
    assert s.update_from_output(second, _out(a=[5])) == []  # computed, never applied
    assert a.output_token_ids == [9]
    assert s.schedule().finished_request_ids == ["a"]  # the runner drops it
    assert s.kv_cache_manager.block_pool.num_free_blocks == 7


def test_a_request_preempted_ahead_keeps_its_token():
    """Preempted by the schedule that ran on its placeholder: the token that comes back is
    kept (a synchronous loop had it before the preemption), and the recompute resumes
    after it."""
    s = _async_scheduler(block_size=8, num_blocks=3, max_model_len=16)
    a = make_request("a", list(range(1, 9)), max_tokens=4)
    b = make_request("b", list(range(11, 18)), max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    first = s.schedule()
    assert {r.request_id for r in first.scheduled} == {"a", "b"}
    second = s.schedule()  # a's decode needs a second block: b, the newest, gives its one
    assert second.preempted_request_ids == ["b"] and b.status == RequestStatus.PREEMPTED
    updates = s.update_from_output(first, _out(a=[20], b=[30]))
    assert {u.request_id: u.new_token_ids for u in updates} == {"a": [20], "b": [30]}
    assert b.output_token_ids == [30] and b.num_output_placeholders == 0
    s.update_from_output(second, _out(a=[21]))
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    again = s.schedule()
    (new,) = again.new_requests
    assert new.request_id == "b" and new.output_token_ids == [30]
    assert [(r.start_pos, r.num_tokens) for r in again.scheduled] == [(0, 8)]
