"""The GPU KV budget's arithmetic (engine.worker.kv_budget), device resolution per rank and
the process-group backend it implies: pure functions, checked on CPU with given numbers."""

from __future__ import annotations

import pytest
import torch

from engine.distributed import backend_for
from engine.worker.kv_budget import GpuMemoryProfile, kv_cache_budget
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


def test_backend_follows_the_resolved_device():
    assert backend_for(torch.device("cuda", 1)) == "nccl"
    assert backend_for("cuda") == "nccl"
    assert backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="no tensor-parallel backend"):
        backend_for("meta")
    # auto resolves first: the backend is never picked from the string "auto".
    auto = resolve_device("auto", rank=1, world_size=2)
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        assert auto == torch.device("cuda", 1) and backend_for(auto) == "nccl"
    elif not torch.cuda.is_available():
        assert auto == torch.device("cpu") and backend_for(auto) == "gloo"


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
