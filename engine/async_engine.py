"""AsyncEngine: the engine for asyncio servers.

The step loop runs on its own thread so the event loop never waits on a forward pass.
Callers talk to it through a thread-safe inbox (add, abort, snapshot); each step's outputs
go back to the event loop in one call_soon_threadsafe, which feeds per-request queues.

An engine that can step no more (a tensor-parallel worker died: EngineDeadError from a step
or from the executor's watcher, or the loop itself crashed) is dead for good: every request
in flight and every new one fails with EngineDeadError, is_healthy() is False, and the
on_dead listeners (the server, which then exits non-zero) are told once, on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from engine.config import EngineConfig
from engine.errors import EngineDeadError, QueueFullError
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.protocol import EngineRequest
from engine.sampling_params import StructuredOutputsParams
from engine.stats import EngineStats, RequestInfo
from engine.structured_output import GrammarError

logger = logging.getLogger("tessera.engine")

_IDLE_POLL_S = 0.2  # how often an idle loop checks for shutdown
# Final outputs kept for abort(wait=True) of requests whose stream ended first: a Generation
# collects its own at once; the bound is for other callers, who may never ask.
_FINALS_KEPT = 256


class _Stream:
    """One request's mailbox on the event loop: outputs are cumulative, so only the newest
    waits (an error, once put, stays); a waiting reader is woken by a bare future, not a
    queue's machinery: this runs once per streamed token."""

    __slots__ = ("item", "waiter")

    def __init__(self) -> None:
        self.item: RequestOutput | BaseException | None = None
        self.waiter: asyncio.Future | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(self.item, BaseException):
            return
        self.item = item
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while self.item is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        item, self.item = self.item, None
        return item


class AsyncEngine:
    def __init__(self, engine: LLMEngine, *, stuck_after_s: float = 60.0) -> None:
        self.engine = engine
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.sampling_defaults = engine.sampling_defaults
        self.runner = engine.runner
        self.pooler = engine.config.model.pooler
        self.model_name = engine.config.served_model_name or engine.config.model.model
        self.stuck_after_s = stuck_after_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}  # touched on the event loop thread only
        # Also the loop's: requests whose stream ended before them, and the final outputs
        # they ended with since (what abort(wait=True) returns), and the acks it awaits.
        self._abandoned: set[str] = set()
        self._finals: collections.OrderedDict[str, RequestOutput] = collections.OrderedDict()
        self._acks: set[concurrent.futures.Future] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._dead_lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        self._dead_listeners: list[Callable[[EngineDeadError], None]] = []
        self._stats = EngineStats(
            num_blocks=engine.num_blocks, block_size=engine.config.cache.block_size
        )

    @classmethod
    async def create(cls, config: EngineConfig, **kwargs) -> AsyncEngine:
        """Load the engine on the thread that then steps it.

        libgomp gives every thread that opens a parallel region a team of its own, and once
        its teams hold more threads than the CPUs, every worker spins only ~100 times before
        sleeping on a futex: each of a step's parallel regions then waits for a wake-up
        (~80 a token). Loading on a helper thread and stepping on another left two teams on
        two cores: a one-stream decode took 8.56 instead of 6.56 ms a token (Zen 3).
        """
        built: concurrent.futures.Future = concurrent.futures.Future()
        handoff: queue.SimpleQueue = queue.SimpleQueue()  # the AsyncEngine to run, or None

        def engine_thread() -> None:
            built.set_running_or_notify_cancel()  # running: create()'s cancellation leaves it
            try:
                engine = LLMEngine(config)
            except BaseException as exc:  # noqa: BLE001 - handed to create()'s caller
                built.set_exception(exc)
                return
            built.set_result(engine)
            owner = handoff.get()
            if owner is None:  # create() gave up (cancelled, or the wrapper failed)
                engine.shutdown()
                return
            owner._run()

        thread = threading.Thread(target=engine_thread, name="tessera-engine", daemon=True)
        thread.start()
        owner = None
        try:
            engine = await asyncio.wrap_future(built)
            candidate = cls(engine, **kwargs)
            candidate._loop = asyncio.get_running_loop()
            candidate._thread = thread
            # A worker's death is heard at once, even while the loop is idle or inside a step.
            engine.executor.on_dead(candidate._mark_dead)
            owner = candidate  # only a complete one runs the loop
        finally:
            handoff.put(owner)
        return owner

    def on_dead(self, listener: Callable[[EngineDeadError], None]) -> None:
        """Call listener(error) on the event loop once, if the engine dies (not on shutdown)."""
        self._dead_listeners.append(listener)
        if self._dead is not None:
            self._call_in_loop(listener, self._dead)

    # -- the public API (event loop thread) ---------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it.

        Stopping the iteration (cancellation, aclose) aborts the request at once. What
        depends on the engine is checked here, once, before the first await (so a refusal
        raises at the caller): the prompt and parameters, the queue's room, a duplicate id;
        the engine thread then adds the request as it is. A request past its tenancy's
        deadline ends with finish_reason "timeout"."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if not self._running():
            raise EngineDeadError("The engine is not running.")
        request_id = request.request_id
        self.engine.validate(request)  # params (or pooling params) resolved
        if request.adapter is not None:  # LoRA on, the folder fits the model (read once)
            self.engine.check_adapter(request.adapter)
        limit = self.config.max_num_queued_requests
        if limit is not None and self._num_queued() >= limit:
            raise QueueFullError(f"The waiting queue is full ({limit} requests); retry shortly.")
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        stream = self._streams[request_id] = _Stream()
        self._inbox.put(("add", request))
        finished = False
        try:
            while True:
                item = await stream.get()  # the newest, when several arrived meanwhile
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._abandoned.add(request_id)
                self._inbox.put(("abort", request_id, None))

    async def compile_grammar(self, so: StructuredOutputsParams) -> None:
        """Compile a structured-output spec (or find it in the cache) off the event loop.

        Raises GrammarError, with a message for the user, for an invalid spec, one over the
        size limits, or one still compiling after the compile timeout (the compile goes on
        in its thread and stays cached, but this request is refused in bounded time)."""
        manager = self.engine.structured
        future = manager.compile(so)
        if not future.done():
            limit = manager.limits.compile_timeout_s
            try:
                # shield: a timeout here must not cancel the cached compile
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), limit)
            except TimeoutError:
                raise GrammarError(
                    f"the grammar took longer than {limit:g} s to compile; simplify it"
                ) from None
        error = future.exception()
        if error is not None:
            raise GrammarError(str(error))

    def _num_queued(self) -> int:
        """Requests waiting for a seat. The engine's count lags a step behind; the streams
        beyond max_num_seqs are known at once (a burst arrives before the next step)."""
        beyond_seats = len(self._streams) - self.config.scheduler.max_num_seqs
        return max(self._stats.num_waiting, beyond_seats)

    async def abort(self, request_id: str, wait: bool = False) -> RequestOutput | None:
        """Abort a request; wait: until the engine has, then the final output it ended with
        if its stream had ended before it (engine.protocol.EngineClient.abort)."""
        if not wait:
            self._abandoned.discard(request_id)  # nobody will ask for its final output
            self._inbox.put(("abort", request_id, None))
            return None
        # Dead or stopping: the streams were (or are about to be) failed, no ack would come.
        if self._dead is None and not self._stopping.is_set() and self._running():
            ack: concurrent.futures.Future = concurrent.futures.Future()
            self._acks.add(ack)
            self._inbox.put(("abort", request_id, ack))
            try:
                # Resolved after the abort's output was handed to the loop (FIFO): the final
                # output is in _finals by the time this resumes.
                with contextlib.suppress(Exception):
                    await asyncio.wrap_future(ack)
            finally:
                self._acks.discard(ack)
        self._abandoned.discard(request_id)
        return self._finals.pop(request_id, None)

    def stats(self) -> EngineStats:
        return self._stats

    async def request_infos(self) -> list[RequestInfo]:
        """The running and waiting requests, read on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("snapshot", future))
        return await asyncio.wrap_future(future)

    async def block_states(self) -> bytes:
        """One byte per KV block: 0 free, 1 in use, 2 free but holding a cached prefix."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("blocks", future))
        return await asyncio.wrap_future(future)

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine died (set on the engine thread, before the listeners hear of it)."""
        return self._dead

    def _running(self) -> bool:
        """Whether the step loop runs: its thread (engine.core_process: its process)."""
        return self._thread is not None and self._thread.is_alive()

    def is_healthy(self) -> bool:
        if self._dead is not None or not self._running():
            return False
        busy = self._stats.num_running or self._stats.num_waiting
        return not busy or time.monotonic() - self._stats.last_step_time < self.stuck_after_s

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    async def shutdown(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        self._publish_stats()
        try:
            while not self._stopping.is_set() and self._dead is None:
                busy = engine.has_unfinished_requests()
                if self._drain_inbox(block=not busy):
                    self._publish_stats()  # adds and aborts change the queues too
                if not engine.has_unfinished_requests():
                    continue
                outputs = step_or_fail(engine)
                self._publish_stats()
                if outputs:
                    self._deliver(outputs)
        except EngineDeadError as exc:
            self._mark_dead(exc)
        except BaseException as exc:  # noqa: BLE001 - the loop must report any death
            logger.exception("Engine loop died")
            dead = EngineDeadError(f"The engine loop died: {type(exc).__name__}: {exc}")
            dead.__cause__ = exc
            self._mark_dead(dead)
        finally:
            self._publish_stats(alive=False)
            if self._dead is None:  # a shutdown: the streams still open end too
                self._call_in_loop(self._fail_all, EngineDeadError("The engine stopped."))

    def _mark_dead(self, exc: EngineDeadError) -> None:
        """The engine can step no more (any thread; the first call wins): fail every stream
        and tell the listeners, on the event loop."""
        with self._dead_lock:
            if self._dead is not None or self._stopping.is_set():
                return
            self._dead = exc
        logger.error("The engine is dead: %s", exc)
        self._call_in_loop(self._fail_all, exc)
        for listener in self._dead_listeners:
            self._call_in_loop(listener, exc)

    def _drain_inbox(self, block: bool) -> bool:
        """Handle every queued command; True if there was any."""
        try:
            item = self._inbox.get(timeout=_IDLE_POLL_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return False
        while True:
            self._handle(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            request = item[1]
            try:
                self.engine.add(request)
            except Exception as exc:  # admitted already: a grammar that failed, say
                self._call_in_loop(self._fail_one, request.request_id, exc)
        elif kind == "abort":
            out = self.engine.abort_request(item[1])
            if out is not None:
                self._deliver([out])
            if item[2] is not None:
                _resolve(item[2])
        elif kind in ("snapshot", "blocks"):
            future = item[1]
            if not future.done():
                manager = self.engine.scheduler.kv_cache_manager
                future.set_result(
                    request_infos(self.engine)
                    if kind == "snapshot"
                    else bytes(manager.block_states())
                )

    def _publish_stats(self, alive: bool = True) -> None:
        self._stats = engine_stats(self.engine, alive)

    # -- back on the event loop -----------------------------------------------------------------

    def _call_in_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._call_in_loop(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
            elif out.finished and out.request_id in self._abandoned:
                self._abandoned.discard(out.request_id)
                self._finals[out.request_id] = out
                if len(self._finals) > _FINALS_KEPT:
                    self._finals.popitem(last=False)

    def _fail_one(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put(exc)

    def _fail_all(self, exc: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(exc)
        self._abandoned.clear()  # nothing more comes: an abort(wait=True) waits no longer
        for ack in list(self._acks):
            _resolve(ack)


def _resolve(ack: concurrent.futures.Future) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # resolved already
        ack.set_result(None)


def step_or_fail(engine: LLMEngine) -> list[RequestOutput]:
    """One step's outputs; a step that fails fails the requests in flight (their final
    outputs), the loop goes on. EngineDeadError (nothing can step again) propagates."""
    try:
        return engine.step()
    except EngineDeadError:
        raise
    except Exception:
        logger.exception("Engine step failed; failing the requests in flight")
        return engine.fail_requests(list(engine.output_processor.states))


def request_infos(engine: LLMEngine) -> list[RequestInfo]:
    """The running and waiting requests (read between steps, on the stepping thread)."""
    scheduler = engine.scheduler
    manager = scheduler.kv_cache_manager
    infos = []
    for status, requests in (
        ("running", scheduler.running),
        ("waiting", scheduler.waiting),
        ("waiting", engine.awaiting_grammar),  # their grammar still compiling
    ):
        for r in list(requests):
            infos.append(
                RequestInfo(
                    request_id=r.request_id,
                    status=status,
                    num_prompt_tokens=r.num_prompt_tokens,
                    num_output_tokens=r.num_output_tokens,
                    num_blocks=manager.num_held_blocks(r.request_id) if status == "running" else 0,
                    arrival_time=r.arrival_time,
                    tenant=r.tenant,
                )
            )
    return infos


def engine_stats(engine: LLMEngine, alive: bool = True) -> EngineStats:
    """The engine's counters and gauges now (read between steps, on the stepping thread)."""
    s = engine.scheduler.stats()
    spec = s.spec_decoding
    return EngineStats(
        num_running=s.num_running,
        num_waiting=engine.num_waiting,
        kv_cache_usage=s.kv_usage,
        num_blocks=engine.num_blocks,
        block_size=engine.config.cache.block_size,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        num_preemptions=s.num_preemptions,
        tenants=s.tenants,
        prompt_tokens_total=engine.prompt_tokens_total,
        generation_tokens_total=engine.generation_tokens_total,
        num_steps=engine.num_steps,
        spec_decode_num_drafts=spec.num_drafts if spec else 0,
        spec_decode_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_decode_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_decode_accepted_per_pos=tuple(spec.accepted_per_pos) if spec else (),
        spec_decode_controller_draft_steps=spec.controller_draft_steps if spec else 0,
        spec_decode_controller_plain_steps=spec.controller_plain_steps if spec else 0,
        last_step_time=time.monotonic(),
        loop_alive=alive,
    )
