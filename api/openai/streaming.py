"""The engine streams behind one HTTP request, SSE framing, and client-disconnect detection.

A `Generation` is what one /v1 request asks of the engine: one engine request per prompt
(n samples each). It is admitted as a unit: `start` waits for every prompt's first output,
so the engine's refusals (bad input, queue full, dead engine) surface before any response
byte is sent and map to a proper HTTP status. Whatever ends the HTTP request (done, error,
client gone), `close` aborts the engine requests that are still running and frees their blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import msgspec

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.protocol import EngineClient, EngineRequest

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"
# What an SSE body yields just before its last chunk: the request is settled (usage row,
# quota reconciled) before the client sees the end of the stream.
SETTLE = object()
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


class RequestObserver(Protocol):
    """Watches engine requests (api/server/metrics.py's Metrics is one): TTFT, ITL, finish reasons."""

    def request_started(
        self, request_id: str, key_name: str | None = None, key_id: str | None = None
    ) -> None: ...

    def observe(self, request_id: str, output: RequestOutput) -> None: ...

    def request_aborted(self, request_id: str) -> None: ...


class ClientDisconnected(Exception):
    """The client closed the connection before the response was complete."""


async def wait_for_disconnect(receive: Callable[[], Awaitable[dict]]) -> None:
    """Returns when the ASGI server reports the client gone (the body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(awaitable: Awaitable[T], receive: Callable[[], Awaitable[dict]]) -> T:
    """Await `awaitable`, but cancel it and raise ClientDisconnected if the client goes away.

    Cancelling the work cancels the engine iteration inside it, which aborts the request."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((work, watcher), return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientDisconnected
    finally:
        watcher.cancel()
        if not work.done():
            work.cancel()


class Generation:
    """The engine requests behind one HTTP request: one per prompt, each with n samples."""

    def __init__(
        self,
        engine: EngineClient,
        requests: list[EngineRequest],
        *,
        on_close: Callable[[Generation], None] | None = None,
        observer: RequestObserver | None = None,
        key_name: str | None = None,
        key_id: str | None = None,
    ) -> None:
        self.engine = engine
        self.request_ids = [r.request_id for r in requests]
        self.prompts = [r.prompt_token_ids for r in requests]
        self.latest: list[RequestOutput | None] = [None] * len(requests)
        self._iters = [engine.generate(r) for r in requests]
        self._on_close = on_close
        self._closing: asyncio.Future[None] | None = None
        self._observer = observer
        self._key_name = key_name
        self._key_id = key_id
        self._observed = False  # the observer saw request_started (admitted requests only)
        self.error: BaseException | None = None  # why start() failed, if it did

    @property
    def finished(self) -> bool:
        return all(o is not None and o.finished for o in self.latest)

    async def start(self) -> None:
        """Wait for each prompt's first output; raises what the engine refused with.

        On failure every engine request of this Generation is aborted before the raise."""
        tasks = [asyncio.ensure_future(self._next(i)) for i in range(len(self._iters))]
        try:
            # AsyncEngine refuses (queue full, bad input) before its first await: after one
            # loop turn a refusal has surfaced, so only admitted requests reach the observer.
            await asyncio.sleep(0)
            for task in tasks:
                if task.done() and task.exception() is not None:
                    raise task.exception()
            if self._observer is not None:
                for rid in self.request_ids:
                    self._observer.request_started(rid, self._key_name, self._key_id)
                self._observed = True
            firsts = await asyncio.gather(*tasks)
        except BaseException as exc:
            self.error = exc  # what on_close settles by: the refusal, not "aborted"
            for task in tasks:  # one prompt was refused: stop the others' first steps too
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()
            raise
        for i, out in enumerate(firsts):
            if out is not None:  # None: the engine ended it at once (aborted meanwhile)
                self._record(i, out)

    async def _next(self, i: int) -> RequestOutput | None:
        try:
            return await anext(self._iters[i])
        except StopAsyncIteration:
            return None

    def _record(self, i: int, out: RequestOutput) -> None:
        self.latest[i] = out
        if self._observed:
            self._observer.observe(self.request_ids[i], out)

    async def updates(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output): first the outputs `start` got, then each new one."""
        for i, out in enumerate(self.latest):
            if out is not None:
                yield i, out
        live = [i for i, out in enumerate(self.latest) if out is not None and not out.finished]
        if len(live) == 1:  # the common case: no task per token (and no wrapper: per token)
            i = live[0]
            it = self._iters[i]
            while True:
                try:
                    out = await anext(it)
                except StopAsyncIteration:
                    return
                self._record(i, out)
                yield i, out
        pending = {asyncio.ensure_future(self._next(i)): i for i in live}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    out = task.result()
                    if out is None:
                        continue
                    self._record(i, out)
                    yield i, out
                    if not out.finished:
                        pending[asyncio.ensure_future(self._next(i))] = i
        finally:
            for task in pending:
                task.cancel()

    async def collect(self) -> list[RequestOutput | None]:
        """Run every prompt to the end; the final outputs, in prompt order."""
        async for _ in self.updates():
            pass
        return self.latest

    def close_soon(self) -> asyncio.Future[None]:
        """Start closing (idempotent) without waiting: for a `finally` of a cancelled task,
        where nothing can be awaited. The close runs as its own task."""
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._close())
        return self._closing

    async def close(self) -> None:
        """Abort what still runs and run `on_close` (idempotent). Every caller waits for the
        same close, and a caller's cancellation does not interrupt it."""
        await asyncio.shield(self.close_soon())

    async def _close(self) -> None:
        try:
            for i, it in enumerate(self._iters):
                out = self.latest[i]
                with contextlib.suppress(Exception):
                    await it.aclose()  # AsyncEngine aborts an unfinished request on close
                if out is None or not out.finished:
                    # Also when the generator could not be closed (its step was cancelled
                    # mid-flight); for a request never added, abort is a no-op. One that
                    # has output waits for the engine: the final output holds every token it
                    # made, which is what it is billed for (a whole answer's outputs stop at
                    # the first). One without (refused, or still queued) bills nothing.
                    final = None
                    with contextlib.suppress(Exception):
                        final = await self.engine.abort(self.request_ids[i], wait=out is not None)
                    if final is not None:
                        self.latest[i] = final
                    if self._observed:
                        self._observer.request_aborted(self.request_ids[i])
        finally:
            if self._on_close is not None:
                self._on_close(self)
