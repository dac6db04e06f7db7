"""How many bytes of a GPU the KV cache may take: the arithmetic, apart from the measuring.

The model runner measures (engine.worker.model_runner._profile_cuda_budget): it runs the
largest step the scheduler can send (a prefill of max_num_batched_tokens tokens, then the
logits of max_num_seqs rows), then reads the driver's view of the device (free and total:
everything in use, by torch or not: the CUDA context, NCCL buffers, other processes) and
torch's own peak. The arithmetic is here, a pure function of those numbers:

    budget = total x gpu_memory_utilization - in use now (total - free) - the step's peak growth

The step's activations are freed when the profile ends, so "in use now" holds the weights
and whatever else lives on the device, and the peak growth is what every later step needs
on top of it. A budget that cannot hold one request of max_model_len tokens is a start-up
error that names every number and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

_GIB = float(1 << 30)


@dataclass(slots=True, frozen=True)
class GpuMemoryProfile:
    total: int  # device memory (torch.cuda.mem_get_info)
    free: int  # free after the profile, torch's cache emptied (mem_get_info)
    torch_allocated: int  # torch's live tensors after the profile: the weights and buffers
    peak_growth: int  # torch's peak during the profiled step minus what it held before

    @property
    def in_use(self) -> int:
        return self.total - self.free

    @property
    def not_torch(self) -> int:
        """In use but not torch's tensors: CUDA context, NCCL, other processes, the cache."""
        return max(0, self.in_use - self.torch_allocated)


def kv_cache_budget(profile: GpuMemoryProfile, utilization: float, need_bytes: int) -> int:
    """Bytes the KV cache may take; raises ValueError if that cannot hold need_bytes (one
    request of max_model_len tokens, in whole blocks, plus the reserved block)."""
    allowed = int(profile.total * utilization)
    budget = allowed - profile.in_use - profile.peak_growth
    if budget < need_bytes:
        raise ValueError(_does_not_fit(profile, utilization, allowed, budget, need_bytes))
    return budget


def _does_not_fit(
    p: GpuMemoryProfile, utilization: float, allowed: int, budget: int, need: int
) -> str:
    def gib(n: int) -> str:
        return f"{n / _GIB:.2f} GiB"

    left = gib(budget) if budget > 0 else "nothing"
    return (
        f"the model does not fit on the GPU with room for the KV cache: of {gib(p.total)} "
        f"total, gpu_memory_utilization {utilization:g} allows {gib(allowed)}; in use "
        f"{gib(p.in_use)} (weights and torch tensors {gib(p.torch_allocated)}, other "
        f"{gib(p.not_torch)}: CUDA context, other processes); the largest step's activations "
        f"peak at {gib(p.peak_growth)} more; that leaves {left} for the KV cache but "
        f"one request of max_model_len needs {gib(need)}. Raise --gpu-memory-utilization, "
        "lower --max-num-batched-tokens, --max-num-seqs or --max-model-len, quantize the "
        "weights, use more GPUs (--tensor-parallel-size) or free the device from other "
        "processes"
    )
