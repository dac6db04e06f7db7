"""The runner's side of async scheduling (engine.worker.async_output): placeholders fed from the
previous step's device ids with no host sync (the dispatch-mode check of test_no_host_sync),
through the CUDA-graph runner's logic and the sampler; the pending output writes the real ids
over the placeholders once read."""

from __future__ import annotations

import random

import pytest
import torch

from engine.attention.metadata import common_metadata_from_seqs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.layers.gpu_sampler import GpuSampler
from engine.outputs import NewRequestData
from engine.sampling_params import SamplingParams
from engine.worker.async_output import (
    PLACEHOLDER,
    AsyncGpuSampler,
    PendingOutput,
    PrevTokens,
    TokenCopies,
)
from engine.worker.cuda_graph import CudaGraphRunner, EagerReplay
from engine.worker.input_batch import CachedRequestState, InputBatch, SamplingTensors
from engine.worker.model_runner import ModelRunner
from engine.worker.step_graph import StepInputs
from tests.engine.worker.test_no_host_sync import NoHostSync

BLOCK = 8


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir), dtype="float32", max_model_len=128, attention_backend="torch"
        ),
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(
            block_size=BLOCK, max_model_len=128, max_num_seqs=8, async_scheduling=True
        ),
    )
    r = ModelRunner(config, model_dir=tiny_llama_dir)
    r.load_model()
    r.init_kv_cache(64)
    return r


def test_placeholders_are_fed_from_the_device_without_sync(runner) -> None:
    """A decode step whose rows 0 and 2 are placeholders: the graph runner's step with their
    ids fed from the last step's device tensor gives the hidden states of the step with the
    ids written in, and neither the feed nor the step waits on the device."""
    rng = random.Random(0)
    free = list(range(1, 64))
    rng.shuffle(free)
    seqs = [(c - 1, 1, [free.pop() for _ in range(-(-c // BLOCK))]) for c in (3, 9, 30)]
    common = common_metadata_from_seqs(seqs, BLOCK)
    positions = [2, 8, 29]
    true_ids = [17, 42, 99]
    prev = PrevTokens(torch.tensor([5, 99, 7, 17]), {"a": 3, "c": 1, "x": 0})
    last_row = {"a": 0, "b": 1, "c": 2}
    ids = [PLACEHOLDER, 42, PLACEHOLDER]
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, (1, 2, 4), 16, EagerReplay(), "cpu")
    graphs.capture_all()
    with torch.inference_mode():
        want = graphs.run(StepInputs(true_ids, positions, common)).clone()
        with NoHostSync():
            fed = prev.feed(ids, last_row, torch.device("cpu"))
            got = graphs.run(StepInputs(ids, positions, common, fed))
    assert fed is not None and fed[0].tolist() == [0, 2] and fed[1].tolist() == [17, 99]
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert prev.feed([1, 2, 3], last_row, torch.device("cpu")) is None  # nothing pending
    with pytest.raises(RuntimeError, match="placeholder"):
        prev.feed([1, PLACEHOLDER, 3], last_row, torch.device("cpu"))  # "b": not last step's


def _state(rid, **params) -> CachedRequestState:
    return CachedRequestState.from_new(
        NewRequestData(rid, [1, 2, 3], SamplingParams(**params), [4], None)
    )


def test_async_sampler_draws_what_the_gpu_sampler_does_without_sync() -> None:
    """The ids stay on the device (and reach the host through TokenCopies): the same draws as
    GpuSampler.sample, step after step, with no host sync in the draw or the copy."""
    reqs = [_state("g", temperature=0.0), _state("s", temperature=0.9, seed=4), _state("u")]
    params = SamplingTensors("cpu")
    for r in reqs:
        params.add(r.request_id, r.sampling_params)
    params.flush()
    plain, ahead = GpuSampler(params, seed=3), AsyncGpuSampler(params, seed=3)
    copies = TokenCopies(torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(len(reqs), 300, generator=g)
        rows = plain.stage([0, 1, 2], [params.column[r.request_id] for r in reqs], [1, 1, 1])
        want = plain.sample(logits.clone(), reqs, rows).tolist()
        with torch.inference_mode(), NoHostSync():
            device_ids = ahead.sample_on_device(logits.clone(), reqs, rows)
            host = copies.start(device_ids)
        assert host.tolist() == want


def test_pending_output_writes_over_the_placeholders() -> None:
    batch = InputBatch()
    a, b = _state("a"), _state("b")
    batch.requests.update(a=a, b=b)
    for s in (a, b):
        s.append_tokens([PLACEHOLDER])
    pending = PendingOutput(batch, ["a", "b", "c"], ["a", "b"], [a, b], [1, 1], [[8], [9]], [1, 1])
    del batch.requests["b"]  # finished before its output was applied: nothing to write
    out = pending.result()
    assert out.sampled_token_ids == {"a": [8], "b": [9], "c": []}
    assert a.output_token_ids == [4, 8] and a.token_ids == [1, 2, 3, 4, 8]
    assert b.output_token_ids == [4, PLACEHOLDER]
    assert pending.result() is out  # read once
