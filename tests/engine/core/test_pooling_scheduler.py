"""Pooling requests in the scheduler, with hand-made ModelRunnerOutputs: a prompt longer than
the budget runs in chunks, the chunk that ends it is the one the runner pools, and the request
then finishes at once ("stop", no token) with every block back; last-token pooling takes a
prefix-cache hit, mean pooling never does. And the step payload carries PoolingParams to
tensor-parallel workers."""

from __future__ import annotations

from core_testing import make_request, make_scheduler

from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.pooling_params import PoolingParams
from engine.worker.step_payload import decode_step, encode_step

LAST = PoolingParams(normalize=True, pooling_type="LAST")
MEAN = PoolingParams(normalize=True, pooling_type="MEAN")


def pooling_request(rid: str, prompt: list[int], params: PoolingParams):
    request = make_request(rid, prompt, max_tokens=1)
    request.pooling_params = params
    return request


def run_chunks(sched, rid: str) -> tuple[list[tuple[int, int, bool]], list]:
    """Step until the request finishes, the runner pooling the chunk that ends its prompt;
    (start, count, sample) of each chunk and the final updates."""
    chunks = []
    while True:
        out = sched.schedule()
        (sr,) = out.scheduled
        chunks.append((sr.start_pos, sr.num_tokens, sr.sample))
        pooled = {rid: [0.5, 0.5]} if sr.sample else {}
        updates = sched.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids={rid: []}, pooled=pooled)
        )
        if updates:
            return chunks, updates


def test_a_pooling_prompt_runs_in_chunks_and_finishes_with_its_vector():
    sched = make_scheduler(max_num_batched_tokens=64)
    sched.add_request(pooling_request("e", list(range(150)), MEAN))
    chunks, updates = run_chunks(sched, "e")
    assert chunks == [(0, 64, False), (64, 64, False), (128, 22, True)]
    (update,) = updates
    assert update.finish_reason == "stop" and update.new_token_ids == []
    assert update.pooled == [0.5, 0.5]
    assert not sched.has_unfinished_requests() and sched.running == []
    pool = sched.kv_cache_manager.block_pool
    assert pool.num_free_blocks == 63  # every block back (block 0 is reserved)
    assert sched.schedule().finished_request_ids == ["e"]  # the runner drops its state


def test_last_token_pooling_takes_a_prefix_hit_and_mean_pooling_does_not():
    sched = make_scheduler(max_num_batched_tokens=256)
    prompt = list(range(40))
    sched.add_request(pooling_request("a", prompt, LAST))
    run_chunks(sched, "a")
    sched.add_request(pooling_request("b", prompt, LAST))
    chunks, _ = run_chunks(sched, "b")
    assert chunks == [(32, 8, True)]  # two cached blocks; the last position recomputed
    sched.add_request(pooling_request("c", prompt, MEAN))
    chunks, _ = run_chunks(sched, "c")
    assert chunks == [(0, 40, True)]  # every row is pooled: no hit


def test_the_step_payload_carries_pooling_params():
    sched = make_scheduler()
    sched.add_request(pooling_request("e", list(range(10)), MEAN))
    out: SchedulerOutput = sched.schedule()
    decoded, _ = decode_step(encode_step(out, {}))
    assert decoded.new_requests[0].pooling_params == MEAN
