"""No host sync inside a step's forward or the GPU sampler: a dispatch mode that fails on every
op that makes the host wait for device values (a scalar read: .item(), bool(t), int(t), a
device tensor's .tolist(); an output whose shape depends on values: nonzero, masked_select,
unique, boolean-mask indexing, ...; a blocking copy between host and device), run over the model's
forward (torch attention backend), the CUDA-graph runner's step and the GPU sampler, on CPU
tensors: the ops they dispatch are the ones they dispatch on CUDA. (A CPU tensor's .tolist()
reads memory without dispatching anything; a CUDA tensor's copies it to the host first, which
the check catches: the `cuda` test.)"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.attention.metadata import common_metadata_from_seqs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.layers.gpu_sampler import GpuSampler
from engine.layers.sampler import Sampler
from engine.outputs import NewRequestData
from engine.sampling_params import SamplingParams
from engine.worker.cuda_graph import CudaGraphRunner, EagerReplay
from engine.worker.input_batch import CachedRequestState, SamplingTensors
from engine.worker.model_runner import ModelRunner
from engine.worker.step_graph import StepInputs

aten = torch.ops.aten
BLOCK = 8

# Ops whose result the host must wait for: a scalar on the host, or a shape from values.
_SYNCING = {
    aten._local_scalar_dense,  # .item(), bool(t), int(t), float(t)
    aten.is_nonzero,
    aten.equal,
    aten.nonzero,
    aten.argwhere,
    aten.masked_select,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.bincount,
}
_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSync(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Raises HostSync on an op that syncs the host with the device (see the module doc)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in _SYNCING:
            raise HostSync(f"{func} waits for device values")
        if packet is aten.repeat_interleave and kwargs.get("output_size") is None:
            raise HostSync(f"{func} without output_size: its length comes from the values")
        if packet in _INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] or ())
        ):
            raise HostSync(f"{func} with a boolean mask: its shape comes from the values")
        if packet is aten._to_copy and _blocking_copy(args[0], kwargs.get("device"), kwargs):
            raise HostSync(f"{func}: a blocking copy between host and device")
        if packet is aten.copy_ and _blocking_copy(args[1], args[0].device, kwargs, args[2:]):
            raise HostSync(f"{func}: a blocking copy between host and device")
        return func(*args, **kwargs)


def _blocking_copy(src, dst_device, kwargs, rest=()) -> bool:
    """A copy between the host and a device without non_blocking: torch then synchronizes
    the stream (either way: a host-to-device one waits for the device's queue too)."""
    non_blocking = kwargs.get("non_blocking", rest[0] if rest else False)
    if not isinstance(src, torch.Tensor) or dst_device is None or non_blocking:
        return False
    kinds = {src.device.type, torch.device(dst_device).type}
    return "cpu" in kinds and len(kinds) == 2


def test_the_check_catches_host_syncs() -> None:
    t = torch.tensor([0.0, 2.0, -1.0, 3.0])
    syncs = [
        lambda: t.sum().item(),  # the deliberate .item()
        lambda: bool((t > 2).any()),
        lambda: int(t.argmax()),
        lambda: t.nonzero(),
        lambda: t[t > 0],
        lambda: torch.unique(t),
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    ]
    for fn in syncs:
        with pytest.raises(HostSync), NoHostSync():
            fn()
    with NoHostSync():  # what the sync-free code does instead
        torch.where(t > 0, t, 0.0).cumsum(0).argmax(-1)
        t.index_select(0, torch.tensor([3, 1]))


def test_the_check_fails_the_cpu_sampler() -> None:
    """The CPU sampler reads results on the host (.tolist(), top-p's nonzero): it is not the
    GPU path, and the check says so."""
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(0))
    reqs = [_req(i, temperature=1.0, top_p=0.9) for i in range(3)]
    with pytest.raises(HostSync), NoHostSync():
        Sampler()(logits, reqs)


def _req(rid, out=(), prompt=(1, 2, 3), num_samples=1, eos=None, **params) -> CachedRequestState:
    state = CachedRequestState.from_new(
        NewRequestData(str(rid), list(prompt), SamplingParams(**params), list(out), eos)
    )
    state.num_samples = num_samples
    return state


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            max_model_len=128,
            attention_backend="torch",
            device="cpu",  # the check runs on any machine: a GPU one's auto device is CUDA
        ),
        cache=CacheConfig(block_size=BLOCK, num_blocks=64),
        scheduler=SchedulerConfig(block_size=BLOCK, max_model_len=128, max_num_seqs=8),
    )
    r = ModelRunner(config, model_dir=tiny_llama_dir)
    r.load_model()
    r.init_kv_cache(64)
    return r


def test_forward_and_graph_step_have_no_host_sync(runner) -> None:
    """A mixed step (decodes, a prefill chunk on a cached prefix, a fresh prompt) through the
    eager forward and the LM head; an all-decode step through the graph runner, padded."""
    rng = random.Random(0)
    free = list(range(1, 64))
    rng.shuffle(free)
    seqs = [(c - 1, 1, [free.pop() for _ in range(-(-c // BLOCK))]) for c in (3, 9, 30)]
    seqs += [(10, 5, [free.pop() for _ in range(2)]), (0, 7, [free.pop()])]
    common = common_metadata_from_seqs(seqs, BLOCK)
    n = common.num_actual_tokens
    ids = torch.tensor([rng.randrange(1, 300) for _ in range(n)])
    positions = torch.tensor([2, 8, 29, *range(10, 15), *range(7)])
    meta = runner.attn_backend.build_metadata(common)  # host work, before the step
    with torch.inference_mode(), NoHostSync():
        hidden = runner.model(ids, positions, meta)
        runner.model.compute_logits(hidden[[2, 7, 14]])
    graphs = CudaGraphRunner(runner.model, runner.attn_backend, (1, 2, 4), 16, EagerReplay(), "cpu")
    graphs.capture_all()
    decodes = common_metadata_from_seqs(seqs[:3], BLOCK)
    with torch.inference_mode(), NoHostSync():
        assert graphs.run(StepInputs(ids[:3].tolist(), [2, 8, 29], decodes)) is not None
    assert graphs.runs == {4: 1}


def _every_stage(device: str):
    """Requests for every stage at once, their parameter tables and the sampler."""
    reqs = [
        _req(0, temperature=0.0),
        _req(1, temperature=0.8, top_k=20, seed=3),
        _req(2, temperature=1.2, top_p=0.9, min_p=0.05),
        _req(3, temperature=1.0, num_samples=3, seed=11, out=[5, 6]),
        _req(4, temperature=0.7, repetition_penalty=1.3, presence_penalty=0.4, out=[9, 9, 1]),
        _req(5, temperature=0.0, frequency_penalty=0.5, logit_bias={7: 5.0}, out=[2]),
        _req(6, temperature=1.0, min_tokens=4, eos=2, stop_token_ids=[8]),
    ]
    params = SamplingTensors(device)
    for r in reqs:
        params.add(r.request_id, r.sampling_params)
    params.flush()
    return reqs, params, GpuSampler(params, seed=1)


def _sample_without_sync(reqs, params, sampler, logits) -> list[list[int]]:
    with torch.inference_mode(), NoHostSync():
        rows = sampler.stage(
            list(range(len(reqs))),
            [params.column[r.request_id] for r in reqs],
            [len(r.output_token_ids) for r in reqs],
        )
        pending = sampler.sample(logits, reqs, rows)
    tokens = pending.tolist()  # the one wait, after the step
    assert [len(t) for t in tokens] == [1, 1, 1, 3, 1, 1, 1]
    assert all(0 <= t < logits.shape[1] for row in tokens for t in row)
    assert tokens[6][0] not in (2, 8)  # masked until min_tokens
    return tokens


def test_gpu_sampler_has_no_host_sync() -> None:
    """Every stage at once: greedy and random rows, temperature, min_p, top_k, top_p, seeds,
    n > 1, penalties, logit_bias and the min_tokens mask; the ids read after the mode."""
    reqs, params, sampler = _every_stage("cpu")
    logits = torch.randn(len(reqs), 1000, generator=torch.Generator().manual_seed(1))
    _sample_without_sync(reqs, params, sampler, logits)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
def test_no_host_sync_on_cuda(runner) -> None:
    """On the device itself: .tolist() of a CUDA tensor is caught; the GPU sampler passes."""
    t = torch.arange(4, device="cuda")
    with pytest.raises(HostSync), NoHostSync():
        t.tolist()
    reqs, params, sampler = _every_stage("cuda")
    logits = torch.randn(len(reqs), 1000, device="cuda")
    _sample_without_sync(reqs, params, sampler, logits)


def test_moe_routing_and_alignment_do_not_sync() -> None:
    """The fused MoE's host side (engine.kernels.triton.fused_moe): the routing's top-k and the
    expert alignment are device ops only, so a MoE layer's CUDA path captures in a graph. (The
    CPU experts path reads its per-expert counts: it is not the CUDA path.)"""
    pytest.importorskip("triton")
    from engine.kernels.triton.fused_moe import moe_align_block_size
    from engine.layers.moe import select_experts

    logits = torch.randn(13, 8, generator=torch.Generator().manual_seed(0))
    with NoHostSync():
        for scoring in ("softmax", "sigmoid"):
            _, ids = select_experts(logits, 2, True, scoring)
        moe_align_block_size(ids, 16, 8)
