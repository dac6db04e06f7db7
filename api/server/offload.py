"""Worker processes for the CPU-heavy steps of a request (chat template, tokenization, checking
a large JSON body), so that no request body can starve the engine's step loop or the event loop.

    pool = WorkerPool(workers=2)
    pool.start(engine.tokenizer)                          # once the engine is loaded
    ids = await pool.tokenizer_call(cost, render_chat, messages, ...)  # fn(tokenizer, ...)
    model = await pool.run_if(cost, check_json_body, body)

A step runs inline while its cost (messages + characters + entries: what it iterates over)
is at most `inline_cost`; beyond that it runs in one of `workers` processes. Threads were not
enough: the engine's step loop is a thread of the server's process, and a thread templating
a big conversation holds the same interpreter lock (a 120,000-message body stretched other
clients' 85 ms completions to 1.3 s). A process has an interpreter of its own; it runs at a
lower CPU priority (nice) so that running streams keep the cores, and holds its own copy of
the tokenizer (sent once, at start). Work beyond the processes waits in asyncio (a
semaphore): a flood of big bodies queues, and /health and small requests keep being answered.

Before `start` (the engine still loading) or where processes cannot be had, the steps run on
threads as before. A process that dies (killed, out of memory) breaks the pool: it is rebuilt
and the step runs once more on the new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TYPE_CHECKING, Any, TypeVar

from engine.orphans import die_with_parent, name_process

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

T = TypeVar("T")
logger = logging.getLogger("tessera.api")

# Inline below this cost: ~16k characters of tokenization or template is well under a
# millisecond's worth of loop time; a process's hand-off (pickling, a pipe) costs more.
INLINE_COST = 16_384
# Workers yield the cores to the engine's compute threads (the nice value is added).
WORKER_NICENESS = 10

_tokenizer: Any = None  # a worker process's copy of the engine's tokenizer


def _init_worker(parent_pid: int, tokenizer_pickle: bytes | None) -> None:
    """A worker process's start: bound to the server's life, lower priority, one thread,
    the tokenizer."""
    global _tokenizer
    die_with_parent(parent_pid)
    name_process("tessera-pool")
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    os.environ["RAYON_NUM_THREADS"] = "1"  # the Rust tokenizer's pool: one core is ours
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    if tokenizer_pickle is not None:
        _tokenizer = pickle.loads(tokenizer_pickle)


def _ready() -> int:
    return os.getpid()


def _with_tokenizer(fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
    return fn(_tokenizer, *args, **kwargs)


def _timed(fn: Callable[..., T], args: tuple, kwargs: dict) -> tuple[T, float]:
    """fn's result and its CPU time in the worker (what the step cost, queueing left out)."""
    t0 = time.thread_time()
    return fn(*args, **kwargs), time.thread_time() - t0


class WorkerPool:
    def __init__(self, workers: int = 2, inline_cost: int = INLINE_COST) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        self.inline_cost = inline_cost
        self.tokenizer: Any = None
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tessera-cpu")
        self._processes: ProcessPoolExecutor | None = None
        self._tokenizer_pickle: bytes | None = None
        self._slots: asyncio.Semaphore | None = None  # made in the loop that uses it
        # Steps run, by name -> (count, CPU seconds): /metrics' tessera:preprocess_* families.
        self.steps: dict[str, list[float]] = {}

    # -- life cycle -------------------------------------------------------------------------

    def start(self, tokenizer: Any) -> None:
        """Start the worker processes with a copy of `tokenizer` (the engine's, once loaded).
        Returns at once: the processes start in the background, each announcing itself."""
        if tokenizer is None or tokenizer is self.tokenizer:  # started (or refused) already
            return
        self.tokenizer = tokenizer
        try:
            self._tokenizer_pickle = pickle.dumps(tokenizer, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - an unpicklable tokenizer keeps the threads
            logger.warning(
                "CPU-heavy request steps stay on threads: the tokenizer cannot be sent to "
                "worker processes (%s: %s)",
                type(exc).__name__,
                exc,
            )
            return
        self._processes = self._new_processes()

    def _new_processes(self) -> ProcessPoolExecutor:
        executor = ProcessPoolExecutor(
            max_workers=self.workers,
            # spawn, never fork: the server holds threads (the engine's, OpenMP's) and locks
            # a forked child would inherit mid-use.
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_worker,
            initargs=(os.getpid(), self._tokenizer_pickle),
        )
        for _ in range(self.workers):  # warm: import and unpickle before the first big body
            executor.submit(_ready)
        return executor

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self._threads.shutdown(wait=False, cancel_futures=True)
        if self._processes is not None:
            processes, self._processes = self._processes, None
            with contextlib.suppress(Exception):
                processes.shutdown(wait=True, cancel_futures=True)

    # -- running steps ----------------------------------------------------------------------

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker process (fn a module-level function, its arguments
        and result picklable), waiting for a free one first; on a thread before `start`."""
        return await self._offload(fn, args, kwargs)

    async def run_if(self, cost: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn inline when `cost` is small, else in a worker process."""
        if cost <= self.inline_cost:
            return self._inline(fn, args, kwargs)
        return await self._offload(fn, args, kwargs)

    async def tokenizer_call(self, cost: int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(tokenizer, *args, **kwargs) with the engine's tokenizer: inline when `cost` is
        small, else in a worker process on its copy (the same vocabulary and template)."""
        if self.tokenizer is None:
            raise RuntimeError("WorkerPool.start(tokenizer) was not called")
        if cost <= self.inline_cost:
            return self._inline(fn, (self.tokenizer, *args), kwargs)
        if self._processes is None:  # no processes: a thread, on the tokenizer itself
            return await self._offload(fn, (self.tokenizer, *args), kwargs)
        return await self._offload(_with_tokenizer, (fn, args, kwargs), {}, step=fn)

    def _inline(self, fn: Callable[..., T], args: tuple, kwargs: dict) -> T:
        t0 = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            self._count(fn, time.thread_time() - t0)

    async def _offload(
        self, fn: Callable[..., T], args: tuple, kwargs: dict, step: Callable | None = None
    ) -> T:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.workers)
        step = step or fn
        async with self._slots:
            loop = asyncio.get_running_loop()
            for attempt in (1, 2):
                executor: Executor = self._processes or self._threads
                try:
                    result, seconds = await loop.run_in_executor(executor, _timed, fn, args, kwargs)
                except BrokenProcessPool:
                    if attempt == 2 or executor is not self._processes:
                        raise
                    logger.error("A request worker process died; starting new ones")
                    with contextlib.suppress(Exception):
                        executor.shutdown(wait=False, cancel_futures=True)
                    self._processes = self._new_processes()
                    continue
                self._count(step, seconds)
                return result
        raise AssertionError("unreachable")

    def _count(self, fn: Callable, seconds: float) -> None:
        entry = self.steps.setdefault(fn.__name__, [0, 0.0])
        entry[0] += 1
        entry[1] += seconds


class WorkerPoolCollector:
    """/metrics: the steps a pool ran (inline or in a worker), by step, and their CPU time."""

    def __init__(self, pool: WorkerPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily

        runs = CounterMetricFamily(
            "tessera:preprocess_steps",
            "CPU-heavy request steps run (chat template, tokenization, body checks), by step.",
            labels=["step"],
        )
        cpu = CounterMetricFamily(
            "tessera:preprocess_cpu_seconds",
            "CPU time of those steps (in the worker processes, or inline).",
            labels=["step"],
        )
        for step, (count, seconds) in sorted(self.pool.steps.items()):
            runs.add_metric([step], count)
            cpu.add_metric([step], seconds)
        yield runs
        yield cpu


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
