"""How many bytes of a GPU the KV cache may take: the arithmetic, apart from the measuring.

The model runner measures (engine.worker.model_runner._profile_cuda_budget): it runs the
largest step the scheduler can send (a prefill of max_num_batched_tokens tokens, then the
logits of max_num_seqs rows), then reads the driver's view of the device (free and total:
everything in use, by torch or not: the CUDA context, NCCL buffers, other processes) and
torch's own peak. The arithmetic is here, a pure function of those numbers:

    budget = total x gpu_memory_utilization - in use now (total - free) - the step's peak growth
             - the CUDA graphs' reserve

The decode graphs (engine.worker.cuda_graph) are captured after the KV cache is allocated,
so their memory pool is reserved beforehand from an estimate (graph_reserve_bytes); after
capture the runner logs the measured pool against it and warns if it ran over.

The step's activations are freed when the profile ends, so "in use now" holds the weights
and whatever else lives on the device, and the peak growth is what every later step needs
on top of it. A budget that cannot hold one request of max_model_len tokens is a start-up
error that names every number and what to change.
"""

from __future__ import annotations

from collections.abc import Sequence
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


_MIB = 1 << 20
# Per captured graph: the allocator rounds a pool's segments to 2 MiB (small tensors share
# one) and the instantiated graph keeps its own device memory (kernel parameters). Measured
# on an H200 (Llama-3-8B shape, the ladder to 256, 21 graphs): 194 MiB taken against 155
# reserved with 2 MiB a graph (216 MiB with the torch ops for norm/rotary/SiLU instead of
# the fused kernels); 4 MiB a graph reserves 197.
GRAPH_OVERHEAD_BYTES = 4 * _MIB
# Once for the capture: torch.cuda.graph captures on a side stream, whose cuBLAS and cuBLASLt
# workspaces (up to 32 MiB each on Hopper) are new memory; mem_get_info counts them.
CAPTURE_WORKSPACE_BYTES = 64 * _MIB


def graph_reserve_bytes(
    ladder: Sequence[int],
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    act_bytes: int,
    outputs_per_row: int = 1,
) -> int:
    """A conservative estimate of the decode graphs' shared pool, from the shapes alone.

    An estimate rather than a trial capture before sizing the cache: it is a pure function
    that is exact to test without a GPU, costs no start-up time, and cannot leave a trial
    pool behind. The graphs share one pool and are captured largest first, so the pool is
    the largest batch's live activations (the others reuse it) plus every graph's output,
    which the graph keeps:

        rows = max(ladder)
        per row = (3 H + (heads + 2 kv_heads) head_dim + heads head_dim + 3 I) x act_bytes
                  (residual, normed input, layer output; qkv; attention output; gate_up 2I and
                  the activation I: a whole layer's tensors live at once, an upper bound)
        reserve = rows x per row + sum(ladder) x H x act_bytes x outputs_per_row
                  + len(ladder) x 4 MiB + 64 MiB (the capture stream's cuBLAS workspaces)

    (ladder: each graph's tokens; outputs_per_row: the hidden-sized outputs a graph keeps,
    1 + an EAGLE-3 head's layers.)

    The logits are not in the graphs (computed eagerly after the replay): the profiled
    step's peak already counts them.
    """
    if not ladder:
        return 0
    rows = max(ladder)
    per_row = (
        3 * hidden_size
        + (num_heads + 2 * num_kv_heads) * head_dim
        + num_heads * head_dim
        + 3 * intermediate_size
    ) * act_bytes
    outputs = sum(ladder) * hidden_size * act_bytes * outputs_per_row
    overhead = len(ladder) * GRAPH_OVERHEAD_BYTES + CAPTURE_WORKSPACE_BYTES
    return rows * per_row + outputs + overhead


def kv_cache_budget(
    profile: GpuMemoryProfile, utilization: float, need_bytes: int, graph_reserve: int = 0
) -> int:
    """Bytes the KV cache may take; raises ValueError if that cannot hold need_bytes (one
    request of max_model_len tokens, in whole blocks, plus the reserved block). graph_reserve:
    the CUDA graphs' pool, captured later (graph_reserve_bytes; 0 where none are captured)."""
    allowed = int(profile.total * utilization)
    budget = allowed - profile.in_use - profile.peak_growth - graph_reserve
    if budget < need_bytes:
        raise ValueError(
            _does_not_fit(profile, utilization, allowed, budget, need_bytes, graph_reserve)
        )
    return budget


def _does_not_fit(
    p: GpuMemoryProfile, utilization: float, allowed: int, budget: int, need: int, graph: int
) -> str:
    def gib(n: int) -> str:
        return f"{n / _GIB:.2f} GiB"

    left = gib(budget) if budget > 0 else "nothing"
    return (
        f"the model does not fit on the GPU with room for the KV cache: of {gib(p.total)} "
        f"total, gpu_memory_utilization {utilization:g} allows {gib(allowed)}; in use "
        f"{gib(p.in_use)} (weights and torch tensors {gib(p.torch_allocated)}, other "
        f"{gib(p.not_torch)}: CUDA context, other processes); the largest step's activations "
        f"peak at {gib(p.peak_growth)} more; the CUDA graphs reserve {gib(graph)} "
        f"(--enforce-eager captures none); that leaves {left} for the KV cache but "
        f"one request of max_model_len needs {gib(need)}. Raise --gpu-memory-utilization, "
        "lower --max-num-batched-tokens, --max-num-seqs or --max-model-len, quantize the "
        "weights, use more GPUs (--tensor-parallel-size) or free the device from other "
        "processes"
    )
