"""Tensor- and pipeline-parallel process groups: the only place layers learn their ranks.

With one rank (the default) nothing in torch.distributed is touched. Worker processes call
init_distributed() before building the model; layers read get_tp_rank()/get_tp_size() when
they are constructed and shard their weights accordingly, the model reads get_pp_rank()/
get_pp_size() to build only its stage's layers (engine.models.pipeline).

Ranks: world = tp_size * pp_size, rank = pp_rank * tp_size + tp_rank (vLLM's layout): the
tensor-parallel group is the tp_size ranks of one stage, the pipeline-parallel group of a
rank is the pp_size ranks with its tp_rank, one per stage. With pp_size 1 the TP group is the
whole world. Stages pass hidden states point to point (pp_send / pp_recv: each TP rank of a
stage to the same TP rank of the next; gloo on CPU, nccl on CUDA).

The backend follows the device the runner resolved (backend_for): nccl for CUDA tensors,
gloo for CPU ones. Every collective waits at most `timeout_s` for its peers, so a rank that
died cannot hold the others in an all-reduce forever (gloo raises; NCCL's watchdog aborts).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

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
    pp_size: int = 1,
) -> None:
    """Join the group (gloo on CPU, nccl on CUDA unless backend is given): world_size ranks,
    pp_size pipeline stages of world_size // pp_size tensor-parallel ranks each.

    timeout_s bounds the rendezvous and every collective."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not valid for world_size {world_size}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    if timeout_s <= 0:
        raise ValueError(f"the collective timeout must be positive seconds, got {timeout_s}")
    if pp_size < 1 or world_size % pp_size:
        raise ValueError(f"world_size {world_size} is not a multiple of pp_size {pp_size}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    # A datetime.timedelta, built from torch's own default so this module imports only torch.
    timeout = type(default_pg_timeout)(seconds=timeout_s)
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
    )
    global _STATE
    tp_size = world_size // pp_size
    tp_group = pp_group = None  # None: the world (one stage / one rank per stage)
    if pp_size > 1:
        # Every rank creates every group, in the same order (torch.distributed's rule).
        for stage in range(pp_size):
            ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
            group = dist.new_group(ranks, timeout=timeout, backend=backend) if tp_size > 1 else None
            if rank in ranks:
                tp_group = group
        for tp_rank in range(tp_size):
            ranks = list(range(tp_rank, world_size, tp_size))
            group = dist.new_group(ranks, timeout=timeout, backend=backend)
            if rank in ranks:
                pp_group = group
    _STATE = _Groups(rank, tp_size, pp_size, tp_group, pp_group)


class _Groups:
    """This process's place: its global rank, the sizes, the TP and PP groups."""

    def __init__(self, rank: int, tp_size: int, pp_size: int, tp_group, pp_group) -> None:
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.tp_rank, self.pp_rank = rank % tp_size, rank // tp_size
        self.tp_group, self.pp_group = tp_group, pp_group


_STATE: _Groups | None = None


def destroy_distributed() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Build modules inside as if this process ran alone: whole weights, no collectives (a
    draft model or EAGLE head replicated on a rank of a tensor-parallel target). Layers read
    the sizes when constructed, so what is built here stays single-rank afterwards."""
    global _STATE
    saved, _STATE = _STATE, None
    try:
        yield
    finally:
        _STATE = saved


def get_tp_rank() -> int:
    return _STATE.tp_rank if _STATE is not None else 0


def get_tp_size() -> int:
    return _STATE.tp_size if _STATE is not None else 1


# --enable-expert-parallel: set by the model runner before it builds the model (each time: a
# process may build several engines), read by the MoE layers as they are constructed.
_EXPERT_PARALLEL = False


def set_expert_parallel(enabled: bool) -> None:
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = enabled


def get_ep_rank_size() -> tuple[int, int]:
    """(this rank's place, ranks) among the expert-parallel group: the tensor-parallel group
    with --enable-expert-parallel, else (0, 1) (every rank holds a slice of every expert)."""
    return (get_tp_rank(), get_tp_size()) if _EXPERT_PARALLEL else (0, 1)


def get_pp_rank() -> int:
    """This rank's pipeline stage (0: the first, which embeds the tokens)."""
    return _STATE.pp_rank if _STATE is not None else 0


def get_pp_size() -> int:
    return _STATE.pp_size if _STATE is not None else 1


def is_first_stage() -> bool:
    return get_pp_rank() == 0


def is_last_stage() -> bool:
    return get_pp_rank() == get_pp_size() - 1


def pp_send(tensors: list[torch.Tensor]) -> None:
    """Send tensors to the same TP rank of the next stage, in order (blocking)."""
    assert _STATE is not None and not is_last_stage()
    dst = _STATE.rank + _STATE.tp_size
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=_STATE.pp_group)


def pp_recv(shapes: list[tuple[int, ...]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """Receive tensors of shapes from the same TP rank of the previous stage (pp_send's)."""
    assert _STATE is not None and not is_first_stage()
    src = _STATE.rank - _STATE.tp_size
    out = []
    for shape in shapes:
        t = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(t, src=src, group=_STATE.pp_group)
        out.append(t)
    return out


def tp_all_reduce(t: torch.Tensor) -> torch.Tensor:
    """Sum t over the group in place (a no-op at tp_size 1)."""
    if get_tp_size() > 1:
        dist.all_reduce(t, group=_STATE.tp_group)
    return t


def tp_broadcast_object(obj):
    """obj from the tensor-parallel group's first rank to each of its ranks (the others pass
    anything, None say, and get the first rank's); obj itself at tp_size 1. Picklable
    objects only: host-side plans, not tensors on a hot path."""
    if get_tp_size() == 1:
        return obj
    group = _STATE.tp_group
    box = [obj]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def tp_all_gather(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's t along dim (t itself at tp_size 1)."""
    size = get_tp_size()
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)
