"""Async scheduling (vLLM v1's): schedule step t+1 while the device computes step t.

Why: a synchronous loop waits for step t's sampled ids before it schedules, prepares and
launches step t+1, so a fast GPU idles through the Python of every step (scheduling, input
preparation, detokenization, stop checks). Here LLMEngine keeps one step in flight: it
schedules and launches t+1 assuming every request step t sampled got exactly one token (a
placeholder, Request.num_output_placeholders), and only then waits for t's ids and applies
them (stop checks, detokenization). The runner feeds t's ids to t+1 on the device
(engine.worker.async_output), so the launch needs nothing from the host. A request that
finished at step t had one more token computed at t+1: dropped with the request, never emitted
nor counted; one sure to end at t by length is not scheduled at t+1 at all.

A step whose next step depends on host state per token runs synchronously: its outputs are
applied before the next schedule (needs_sync): a grammar's bitmask needs the grammar advanced
by the last token, penalties read the output ids, and an n > 1 parent forks its samples from
its first step's ids. Tensor parallelism keeps the synchronous loop (the other ranks get each
step's ids from the driver's next payload).

On the CPU the forward runs on the cores that run the Python, so there is no device time to
hide it in: off by default there (the same code runs when asked, which is how it is tested).
Measured on 2 shared cores, default model, batch 1 and 32: scheduling plus applying the
outputs is 0.3-0.4% of a synchronous step, and on/off throughput is within the noise (the
sign of a few % follows which engine runs second).
"""

from __future__ import annotations

from collections.abc import Mapping

from engine.outputs import SchedulerOutput
from engine.request import Request


def resolve_async_scheduling(option: bool | None, device: str, tensor_parallel_size: int) -> bool:
    """The option's value: None (auto) = on for CUDA with one rank. Raises ValueError when it
    is asked for where it does not run."""
    if option is None:
        return device == "cuda" and tensor_parallel_size == 1
    if option and tensor_parallel_size > 1:
        raise ValueError(
            "async scheduling runs with tensor_parallel_size 1 only: drop --async-scheduling "
            f"or use one rank (got tensor_parallel_size {tensor_parallel_size})"
        )
    return option


def needs_sync(so: SchedulerOutput, requests: Mapping[str, Request]) -> bool:
    """Whether the step's output must be applied before the next step is scheduled: it
    sampled for a request whose next step depends on host state per token."""
    for sr in so.scheduled:
        if not sr.sample:
            continue
        if sr.num_samples > 1:
            return True
        request = requests.get(sr.request_id)
        if request is not None and (
            request.grammar is not None or request.sampling_params.needs_penalties
        ):
            return True
    return False
