"""Tensor-parallel process group: the only place layers learn their rank and world size.

With tp_size 1 (the default) nothing in torch.distributed is touched. Worker processes call
init_distributed() before building the model; layers read get_tp_rank()/get_tp_size() when
they are constructed and shard their weights accordingly.

The backend follows the device the runner resolved (backend_for): nccl for CUDA tensors,
gloo for CPU ones. Every collective waits at most `timeout_s` for its peers, so a rank that
died cannot hold the others in an all-reduce forever (gloo raises; NCCL's watchdog aborts).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

DEFAULT_COLLECTIVE_TIMEOUT_S = 300.0


def backend_for(device: torch.device | str) -> str:
    """The process-group backend for tensors on `device` (a resolved device, not "auto")."""
    kind = torch.device(device).type
    if kind == "cuda":
        return "nccl"
    if kind == "cpu":
        return "gloo"
    raise ValueError(f"no tensor-parallel backend for device {device!r} (cpu or cuda)")


def bind_cuda_device(device: torch.device | str) -> None:
    """Make `device` this process's current CUDA device: before anything allocates on CUDA,
    so the rank's context, NCCL communicator and kernel launches land on its own GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)


def init_distributed(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None = None,
    timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
) -> None:
    """Join the tensor-parallel group (gloo on CPU, nccl on CUDA unless backend is given).

    timeout_s bounds the rendezvous and every collective."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not valid for world_size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    if timeout_s <= 0:
        raise ValueError(f"the collective timeout must be positive seconds, got {timeout_s}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # A datetime.timedelta, built from torch's own default so this module imports only torch.
    timeout = type(default_pg_timeout)(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def get_tp_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum t over the group in place (a no-op at tp_size 1)."""
    if get_tp_size() > 1:
        dist.all_reduce(t)
    return t


def tp_all_gather(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's t along dim (t itself at tp_size 1)."""
    size = get_tp_size()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)
