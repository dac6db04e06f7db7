"""The runner's persistent input batch, rebuilt from incremental SchedulerOutputs, equals the
scheduler's view of every request, step after step: the real scheduler drives the real
ModelRunner (tiny Llama) through chunked prefill, preemption, an n=2 fork and an abort; a
second input batch fed only the bytes a tensor-parallel worker gets stays equal to rank 0's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.core.scheduler import Scheduler
from engine.outputs import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.worker.input_batch import CachedRequestState, InputBatch
from engine.worker.model_runner import ModelRunner
from engine.worker.multiproc import _call_decoder, step_message
from engine.worker.step_payload import decode_step

BLOCK = 8
MAX_LEN = 128


def _assert_same(a: CachedRequestState, b: CachedRequestState) -> None:
    assert a.token_ids == b.token_ids and a.output_token_ids == b.output_token_ids
    assert a.prompt_token_ids == b.prompt_token_ids
    assert np.array_equal(a.block_table, b.block_table)
    assert a.sampling_params == b.sampling_params and a.eos_token_id == b.eos_token_id


def test_runner_state_follows_the_scheduler(tiny_llama_dir):
    torch.set_num_threads(1)
    sched_cfg = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=32, max_model_len=MAX_LEN, block_size=BLOCK
    )
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=MAX_LEN),
        cache=CacheConfig(block_size=BLOCK, num_blocks=24),
        scheduler=sched_cfg,
    )
    runner = ModelRunner(config, model_dir=tiny_llama_dir)
    runner.load_model()
    runner.init_kv_cache(24)
    sched = Scheduler(sched_cfg, config.cache, 24)
    sampled_params = SamplingParams(
        n=2, max_tokens=30, temperature=1.0, seed=5, repetition_penalty=1.2, ignore_eos=True
    )
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = {"a": list(range(10, 60)), "b": list(range(100, 137)), "c": [3, 9, 27, 81]}
    sched.add_request(Request("a", prompts["a"], greedy, eos_token_id=2))
    sched.add_request(Request("p", list(range(200, 219)), sampled_params, eos_token_id=2))
    sched.add_request(Request("b", prompts["b"], greedy, eos_token_id=2))
    worker = InputBatch()  # a tensor-parallel rank: fed the channel's bytes only
    prev_sampled: dict[str, list[int]] = {}
    seen = {"chunk": 0, "fork": 0, "new_again": 0}
    manager = sched.kv_cache_manager
    for step in range(400):
        if not sched.has_unfinished_requests():
            break
        if step == 6:
            sched.add_request(Request("c", prompts["c"], greedy, eos_token_id=2))
        if step == 30:
            sched.finish_requests("c", RequestStatus.FINISHED_ABORTED)
        out = sched.schedule()
        seen["chunk"] += sum(not s.sample for s in out.scheduled)
        seen["fork"] += sum(s.num_samples == 2 for s in out.scheduled)
        seen["new_again"] += sum(bool(n.output_token_ids) for n in out.new_requests)
        result = runner.execute_model(out)

        # The worker's view: the previous step's samples, then this step, from the bytes.
        _, body = _call_decoder.decode(step_message(out, prev_sampled))
        so, sampled = decode_step(body)
        worker.append_sampled(sampled)
        worker.update(so)
        prev_sampled = {r: t for r, t in result.sampled_token_ids.items() if t}

        batch = runner.input_batch
        running = {r.request_id for r in sched.running}
        assert set(batch.requests) <= running
        assert {s.request_id for s in out.scheduled} <= set(batch.requests)
        sched.update_from_output(out, result)
        for rid, state in batch.requests.items():
            request = sched.get_request(rid)
            if request is None:  # finished this step: dropped with the next output
                continue
            assert state.token_ids == request.all_token_ids, (step, rid)
            assert state.output_token_ids == request.output_token_ids, (step, rid)
            assert state.block_table.tolist() == manager.get_block_ids(rid), (step, rid)
            assert state.sampling_params == request.sampling_params
        # The worker lags one step in sampled tokens only, and catches up on the next.
        assert set(worker.requests) == set(batch.requests)
        for rid in worker.requests:
            w, b = worker[rid], batch[rid]
            mine = prev_sampled.get(rid, [])
            lag = min(len(mine), 1) if b.num_samples > 1 else len(mine)
            assert w.token_ids == b.token_ids[: len(b.token_ids) - lag]
            assert np.array_equal(w.block_table, b.block_table)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0 and all(seen.values()), seen
    last = sched.schedule()  # nothing to run: only the drops of the last finished requests
    assert last.is_empty and last.drops_requests
    runner.execute_model(last)
    assert len(runner.input_batch) == 0


def test_unknown_or_unsent_tokens_are_refused():
    batch = InputBatch()
    with pytest.raises(RuntimeError, match="does not hold it"):
        batch.update(SchedulerOutput([ScheduledRequest("x", 0, 3, [1], True)], 3))
    new = NewRequestData("x", [1, 2, 3], SamplingParams())
    with pytest.raises(RuntimeError, match="knows only 3 tokens"):
        batch.update(SchedulerOutput([ScheduledRequest("x", 2, 2, [1], True)], 2, [new]))


def test_block_table_grows_and_forked_parents_keep_their_first_sample():
    batch = InputBatch()
    new = NewRequestData("p", [1, 2, 3], SamplingParams(n=3), eos_token_id=0)
    batch.update(SchedulerOutput([ScheduledRequest("p", 0, 3, [7], True, 3)], 3, [new]))
    batch.append_sampled({"p": [10, 11, 12]})
    assert batch["p"].output_token_ids == [10] and batch["p"].token_ids == [1, 2, 3, 10]
    ids = list(range(1, 40))
    batch.update(SchedulerOutput([ScheduledRequest("p", 3, 1, ids, True)], 1))
    assert batch["p"].block_table.tolist() == [7, *ids]
    assert batch["p"].block_table.dtype == np.int32
    batch.append_sampled({"p": [13]})
    assert batch["p"].output_token_ids == [10, 13]
    batch.update(SchedulerOutput([], 0, preempted_request_ids=["p"]))
    assert "p" not in batch
