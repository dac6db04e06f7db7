"""The GPU KV budget's arithmetic (engine.worker.kv_budget), device resolution per rank and
the process-group backend it implies: pure functions, checked on CPU with given numbers."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import backend_for
from engine.worker.cuda_graph import batch_ladder
from engine.worker.kv_budget import (
    CAPTURE_WORKSPACE_BYTES,
    GRAPH_OVERHEAD_BYTES,
    GpuMemoryProfile,
    graph_reserve_bytes,
    kv_cache_budget,
)
from engine.worker.model_runner import check_visible_gpus, resolve_device

GIB = 1 << 30


def test_budget_is_the_allowed_share_less_everything_in_use_and_the_step_peak():
    # 80 GiB device; 16 GiB weights, 2 GiB context/NCCL/another process; a 3 GiB step peak.
    p = GpuMemoryProfile(
        total=80 * GIB, free=62 * GIB, torch_allocated=16 * GIB, peak_growth=3 * GIB
    )
    assert p.in_use == 18 * GIB and p.not_torch == 2 * GIB
    assert kv_cache_budget(p, 0.9, need_bytes=GIB) == int(80 * GIB * 0.9) - 18 * GIB - 3 * GIB
    # Memory used by others (not torch) counts exactly like our own.
    other = GpuMemoryProfile(80 * GIB, 52 * GIB, 16 * GIB, 3 * GIB)
    assert kv_cache_budget(other, 0.9, GIB) == kv_cache_budget(p, 0.9, GIB) - 10 * GIB
    assert kv_cache_budget(p, 1.0, GIB) - kv_cache_budget(p, 0.5, GIB) == 40 * GIB


def test_a_model_that_does_not_fit_names_the_numbers_and_what_to_change():
    p = GpuMemoryProfile(
        total=24 * GIB, free=8 * GIB, torch_allocated=15 * GIB, peak_growth=2 * GIB
    )
    # allowed 21.6 GiB - 16 in use - 2 peak = 3.6 GiB < the 4 GiB one request needs
    with pytest.raises(ValueError) as err:
        kv_cache_budget(p, 0.9, need_bytes=4 * GIB)
    msg = str(err.value)
    for part in (
        "24.00 GiB total",
        "gpu_memory_utilization 0.9 allows 21.60 GiB",
        "in use 16.00 GiB",
        "weights and torch tensors 15.00 GiB",
        "other 1.00 GiB",
        "peak at 2.00 GiB",
        "leaves 3.60 GiB",
        "needs 4.00 GiB",
        "CUDA graphs reserve 0.00 GiB",
        "--gpu-memory-utilization",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--tensor-parallel-size",
    ):
        assert part in msg, (part, msg)
    # Over budget already before the cache: "nothing" left, not a negative size.
    full = GpuMemoryProfile(total=24 * GIB, free=GIB, torch_allocated=22 * GIB, peak_growth=GIB)
    with pytest.raises(ValueError, match="leaves nothing for the KV cache"):
        kv_cache_budget(full, 0.9, need_bytes=1)


def test_the_graph_reserve_shrinks_the_budget_and_is_named_when_it_does_not_fit():
    p = GpuMemoryProfile(80 * GIB, 62 * GIB, 16 * GIB, 3 * GIB)
    plain = kv_cache_budget(p, 0.9, GIB)
    assert kv_cache_budget(p, 0.9, GIB, graph_reserve=GIB // 2) == plain - GIB // 2
    # It fits without the reserve, not with it: the error names the reserve.
    with pytest.raises(ValueError) as err:
        kv_cache_budget(p, 0.9, need_bytes=plain, graph_reserve=GIB)
    msg = str(err.value)
    assert "CUDA graphs reserve 1.00 GiB" in msg and "--enforce-eager" in msg, msg
    assert f"leaves {(plain - GIB) / GIB:.2f} GiB" in msg, msg


LLAMA_8B = dict(
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=14336,
    act_bytes=2,
)


def test_graph_reserve_is_the_largest_batch_activations_plus_every_output():
    ladder = batch_ladder(256)
    r = graph_reserve_bytes(ladder, **LLAMA_8B)
    per_row = (3 * 4096 + (32 + 16) * 128 + 32 * 128 + 3 * 14336) * 2
    overhead = len(ladder) * GRAPH_OVERHEAD_BYTES + CAPTURE_WORKSPACE_BYTES
    want = 256 * per_row + sum(ladder) * 4096 * 2 + overhead
    assert r == want
    # Llama-8B at 256 sequences in bf16: ~90 MiB of activations and outputs, under a GiB.
    assert 150 << 20 < r < GIB
    assert graph_reserve_bytes((), **LLAMA_8B) == 0


def test_graph_reserve_grows_with_max_num_seqs_and_the_model_width():
    by_seqs = [graph_reserve_bytes(batch_ladder(n), **LLAMA_8B) for n in (1, 8, 64, 256, 512)]
    assert by_seqs == sorted(by_seqs) and len(set(by_seqs)) == len(by_seqs)
    # The ladder stops at 512: more sequences capture no more graphs.
    assert graph_reserve_bytes(batch_ladder(1024), **LLAMA_8B) == by_seqs[-1]
    wider = {**LLAMA_8B, "hidden_size": 8192, "intermediate_size": 28672}
    assert graph_reserve_bytes(batch_ladder(256), **wider) > by_seqs[3]
    fp32 = {**LLAMA_8B, "act_bytes": 4}
    assert graph_reserve_bytes(batch_ladder(256), **fp32) > by_seqs[3]


def test_backend_follows_the_resolved_device():
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="no tensor-parallel backend"):
        backend_for("meta")
    # auto resolves first: the backend is never picked from the string "auto".
    if not torch.cuda.is_available():
        auto = resolve_device("auto", rank=1, world_size=2)
        assert auto == torch.device("cpu") and backend_for(auto) == "gloo"
    elif torch.cuda.device_count() >= 2:
        auto = resolve_device("auto", rank=1, world_size=2)
        assert auto == torch.device("cuda", 1) and backend_for(auto) == "nccl"
    else:  # one GPU: two ranks cannot each have one
        with pytest.raises(ValueError, match="needs 2 GPUs, one per rank, but 1 is visible"):
            resolve_device("auto", rank=1, world_size=2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="no CUDA device is available"):
        resolve_device("cuda")


def test_more_ranks_than_gpus_is_a_clear_error(monkeypatch):
    check_visible_gpus(2, 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ValueError) as err:
        check_visible_gpus(4, 1)
    assert str(err.value) == (
        "tensor_parallel_size 4 needs 4 GPUs, one per rank, but 1 is visible "
        "(CUDA_VISIBLE_DEVICES=0): lower --tensor-parallel-size or make more GPUs visible"
    )


def test_the_profiled_step_is_the_largest_one(tiny_llama_dir):
    """The step the CUDA profile measures runs on any device: a prefill of the whole token
    budget, then logits for max_num_seqs rows (more rows than tokens: rows repeat)."""
    from engine import EngineConfig, ModelConfig, SchedulerConfig
    from engine.worker.model_runner import ModelRunner

    config = EngineConfig(
        model=ModelConfig(
            model=str(tiny_llama_dir),
            dtype="float32",
            device="cpu",
            max_model_len=256,
            attention_backend="torch",  # the reference, as on CUDA without Triton
        ),
        scheduler=SchedulerConfig(max_num_seqs=40, max_num_batched_tokens=32, max_model_len=256),
    )
    runner = ModelRunner(config, model_dir=tiny_llama_dir)
    runner.load_model()
    logits = runner._profile_step()
    assert logits.shape == (40, runner.hf_config.vocab_size)
    assert torch.isfinite(logits).all()
    # speculative decoding: logits at every draft position the step budget allows
    from engine.spec_decode import SpeculativeConfig

    config.scheduler.speculative_config = SpeculativeConfig(num_speculative_tokens=3)
    config.scheduler.max_num_seqs = 4
    assert runner._profile_step().shape == (16, runner.hf_config.vocab_size)
    config.scheduler.max_num_seqs = 10
    assert runner._profile_step().shape == (32, runner.hf_config.vocab_size)  # the budget
