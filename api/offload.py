"""A bounded worker pool for the CPU-heavy steps of a request (chat template, tokenization,
large logit_bias / stop-list validation), so that no request body can stall the event loop.

    pool = WorkerPool(workers=2)
    ids = await pool.run_if(cost, tokenizer.encode, text)   # cost in input-size units

A step runs inline while its cost (messages + characters + entries: what it iterates over)
is at most `inline_cost`; beyond that it runs on one of `workers` threads. Work beyond the
threads waits in asyncio (a semaphore), not in the loop: a flood of big bodies queues, and
/health, /version and small requests keep being answered meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")

# Inline below this cost: ~16k characters of tokenization or template is well under a
# millisecond's worth of loop time; the threads' hand-off costs more than that.
INLINE_COST = 16_384


class WorkerPool:
    def __init__(self, workers: int = 2, inline_cost: int = INLINE_COST) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.inline_cost = inline_cost
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tessera-cpu")
        self._slots: asyncio.Semaphore | None = None  # made in the loop that uses it
        self.offloaded = 0  # steps that ran on a worker thread (tests, metrics)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a worker thread, waiting for a free one first."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        async with self._slots:
            self.offloaded += 1
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    async def run_if(self, cost: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn inline when `cost` is small, else on a worker thread."""
        if cost <= self.inline_cost:
            return fn(*args, **kwargs)
        return await self.run(fn, *args, **kwargs)

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._executor.shutdown(wait=False, cancel_futures=True)


def messages_cost(messages: Any) -> int:
    """Input-size cost of templating chat messages, computed without iterating more than
    `INLINE_COST` of them on the caller's thread (past that, the answer is 'large')."""
    n = len(messages)
    if n > INLINE_COST:
        return n
    cost = n
    for m in messages:
        content = getattr(m, "content", None)
        if isinstance(content, str):
            cost += len(content)
        elif content:
            cost += sum(len(getattr(p, "text", None) or "") + 1 for p in content)
    return cost


def sampling_cost(data: Any) -> int:
    """Entries that SamplingParams validation walks: logit_bias, stop, stop_token_ids."""
    stop = getattr(data, "stop", None)
    n_stop = 1 if isinstance(stop, str) else len(stop or ())
    chars = len(stop) if isinstance(stop, str) else 0
    return (
        len(getattr(data, "logit_bias", None) or ())
        + n_stop
        + chars
        + len(getattr(data, "stop_token_ids", None) or ())
    )
