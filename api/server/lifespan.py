"""The server's life: load the engine, serve, drain, stop.

ServerState is the one object routes ask "may I start work?" (`require_engine`) and the
signal handler asks to drain. The engine loads in the background so /health can answer 503
while it loads (an API server other than the parent, with --api-server-count, attaches to the
parent's core before it listens: the parent answers meanwhile); generation requests get 503
with Retry-After until it is ready and again once draining starts. An engine that dies while
serving (a tensor-parallel worker died) is fatal: /health answers 503, requests fail with 503,
and the server stops and exits non-zero so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import gc
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from api.server.errors import unavailable
from api.server.logs import configure_logging
from api.server.settings import Settings
from engine.protocol import EngineClient

if TYPE_CHECKING:
    from litestar import Litestar

    from api.lora.registry import AdapterRegistry
    from api.openai.streaming import Generation
    from api.server.access import Access

logger = logging.getLogger("tessera.api")

# After in-flight requests were aborted at the drain deadline, how long their responses get
# to deliver the final error event before the server closes connections.
_ABORT_FLUSH_S = 2.0


class Phase(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServerState:
    def __init__(self, settings: Settings, engine: EngineClient | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.owns_engine = engine is None  # an engine passed in is the caller's to shut down
        self._frozen = False  # gc.freeze() after our engine loaded; undone at stop
        self.phase = Phase.READY if engine is not None else Phase.LOADING
        self.load_error: str | None = None
        self.engine_error: str | None = None  # why a running engine died; the server exits 1
        self.started_at = time.time()
        # Keys the per-tenant prefix-cache salts (api/tenants/tenancy.py); never leaves the
        # process (or, with --api-server-count, the server's processes: the parent's is handed down).
        self.cache_salt_secret = secrets.token_bytes(32)
        # --api-server-count (api/server/api_servers.py): the parent's engine hands the core
        # the other servers' channels (core_peers); another server's engine attaches to the
        # core through its own (core_channel). Hooks run before our engine stops (the parent
        # waits for the other servers there).
        self.core_peers: list[tuple] = []
        self.core_channel: tuple | None = None
        self.before_engine_stop: list[Callable[[float], Awaitable[None]]] = []
        # Called when the server should exit on its own (the engine failed to load or died);
        # the CLI points it at uvicorn's should_exit.
        self.on_fatal: Callable[[], None] | None = None
        # Called with the engine once it is there (the app starts its worker processes).
        self.on_engine: list[Callable[[EngineClient], None]] = []
        # The served LoRA adapters (api/lora/registry.py), with --enable-lora; started (the
        # --lora-modules folders checked) once the engine is there, before it is READY.
        self.adapters: AdapterRegistry | None = None
        self._inflight: set[Generation] = set()
        self._idle: asyncio.Event | None = None
        self._load_task: asyncio.Task | None = None
        self._drain_task: asyncio.Task | None = None

    # -- admission ------------------------------------------------------------------------------

    def require_engine(self) -> EngineClient:
        """The engine, or a 503 (with Retry-After) that says why no work is admitted now."""
        self._take_engine_death()
        if self.engine_error is not None:
            raise unavailable(f"The engine died: {self.engine_error}", retry_after=5)
        if self.phase is Phase.READY and self.engine is not None:
            return self.engine
        if self.phase is Phase.LOADING:
            raise unavailable("The model is still loading; retry shortly.", retry_after=5)
        if self.phase in (Phase.DRAINING, Phase.STOPPED):
            raise unavailable("The server is shutting down; retry on another replica.", 5)
        raise unavailable(f"The engine failed to start: {self.load_error}", retry_after=30)

    def track(self, generation: Generation) -> None:
        self._inflight.add(generation)
        if self._idle is not None:
            self._idle.clear()

    def untrack(self, generation: Generation) -> None:
        self._inflight.discard(generation)
        if not self._inflight and self._idle is not None:
            self._idle.set()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def health(self) -> tuple[bool, str]:
        """(healthy, status word) for /health."""
        self._take_engine_death()
        if self.engine_error is not None:
            return False, "engine_dead"
        if self.phase is not Phase.READY:
            return False, self.phase.value
        if not self.engine.is_healthy():
            return False, "engine_unhealthy"
        return True, "ok"

    # -- life cycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        if self.engine is None:
            self._load_task = asyncio.create_task(self._load(), name="tessera-load-engine")
            if self.core_channel is not None:
                # Another API server of several: attach before uvicorn starts accepting on the
                # shared socket. The kernel hands each connection to whichever server accepts
                # it, so one still attaching would answer 503 while the parent already serves.
                await self._load_task
        else:
            if self.adapters is not None:
                await self.adapters.start(self.engine)
            self._watch_engine(self.engine)

    async def _load(self) -> None:
        t0 = time.monotonic()
        try:
            config = self.settings.create_engine_config()
            if self.core_channel is not None:
                from engine.core_process import ProcessEngine  # heavy (torch): when serving

                engine = await ProcessEngine.attach(self.core_channel)
            elif getattr(self.settings, "engine_process", False) or self.core_peers:
                from engine.core_process import ProcessEngine

                init = functools.partial(
                    configure_logging,
                    self.settings.log_level,
                    self.settings.log_format,
                    server="core" if self.core_peers else None,
                )
                peers, self.core_peers = self.core_peers, []
                engine = await ProcessEngine.create(config, child_init=init, peers=peers)
            else:
                from engine.async_engine import AsyncEngine  # heavy (torch): when serving

                engine = await AsyncEngine.create(config)
        except Exception as exc:  # noqa: BLE001 - any load failure ends the server
            logger.exception("The engine failed to load")
            for end in (end for peer in self.core_peers for end in peer):
                end.close()  # no core for the other servers: they see the pipes end
            self._fail(exc)
            return
        try:
            if self.adapters is not None:
                await self.adapters.start(engine)  # a bad --lora-modules folder: fatal
        except Exception as exc:  # noqa: BLE001
            logger.error("Start-up failed: %s", exc)
            with contextlib.suppress(Exception):
                await engine.shutdown()
            self._fail(exc)
            return
        self._finish_load(engine, t0)

    def _fail(self, exc: BaseException) -> None:
        self.load_error = f"{type(exc).__name__}: {exc}"
        self.phase = Phase.FAILED
        if self.on_fatal is not None:
            self.on_fatal()

    def _finish_load(self, engine: EngineClient, t0: float) -> None:
        self.engine = engine
        self._watch_engine(engine)
        # The model, the tokenizer and the imports are ~370,000 long-lived objects: a full
        # collection walked them all in ~200 ms with the GIL held, stalling the engine's step.
        # Frozen, collections see only what requests allocate (vLLM does the same). The server
        # holds one engine for its life, so nothing frozen was waiting to be collected.
        gc.collect()
        gc.freeze()
        self._frozen = True
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
            logger.info(
                "Engine ready in %.1f s: model %s, max_model_len %d",
                time.monotonic() - t0,
                engine.model_name,
                engine.max_model_len,
            )

    def _watch_engine(self, engine: EngineClient) -> None:
        for callback in self.on_engine:
            callback(engine)
        on_dead = getattr(engine, "on_dead", None)  # test doubles may not have it
        if on_dead is not None:
            on_dead(self._engine_died)

    def _take_engine_death(self) -> None:
        """The engine marks itself dead a loop turn before its listener reaches us: take the
        news from the engine itself, so /health and admission say "died" from that moment."""
        dead = getattr(self.engine, "dead_error", None)  # test doubles may not have it
        if dead is not None:
            self._engine_died(dead)

    def _engine_died(self, exc: BaseException) -> None:
        """The engine can serve no more: fail fast and stop, so a supervisor restarts us."""
        if self.engine_error is not None:
            return
        self.engine_error = str(exc)
        logger.error("The engine died (%s): stopping the server", exc)
        if self.on_fatal is not None:
            self.on_fatal()

    async def drain(self, timeout: float) -> None:
        """Stop admitting, let in-flight requests finish for up to `timeout` s, abort the rest.

        Idempotent: a second call waits for the first drain."""
        if self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain(timeout), name="tessera-drain")
        await asyncio.shield(self._drain_task)

    async def _drain(self, timeout: float) -> None:
        if self.phase in (Phase.READY, Phase.LOADING):
            self.phase = Phase.DRAINING
        if not self._inflight:
            return
        logger.info("Draining: %d request(s) in flight, up to %.0f s", len(self._inflight), timeout)
        if await self._wait_idle(timeout):
            return
        logger.warning("Drain timeout: aborting %d request(s)", len(self._inflight))
        await self.abort_all()
        await self._wait_idle(_ABORT_FLUSH_S)

    async def abort_all(self) -> None:
        if self.engine is None:
            return
        for generation in list(self._inflight):
            for rid in generation.request_ids:
                await self.engine.abort(rid)

    async def _wait_idle(self, timeout: float) -> bool:
        assert self._idle is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout)
        return not self._inflight

    async def stop(self) -> None:
        """Lifespan shutdown: finish loading (a half-loaded engine must still be stopped),
        drain if no one did, then stop an engine we own."""
        if self._load_task is not None and not self._load_task.done():
            self.phase = Phase.DRAINING
            with contextlib.suppress(Exception):
                await self._load_task
        await self.drain(self.settings.shutdown_timeout)
        self.phase = Phase.STOPPED
        if self.adapters is not None:
            await self.adapters.stop()
        for hook in self.before_engine_stop:
            await hook(self.settings.shutdown_timeout)
        if self.engine is not None and self.owns_engine:
            await self.engine.shutdown()
        if self._frozen:  # what the engine held may now be collected (cycles included)
            gc.unfreeze()
            self._frozen = False


def make_access_lifespan(
    access: Access,
) -> Callable[[Litestar], contextlib.AbstractAsyncContextManager]:
    """Database, keys, quotas and ledger: up before the engine lifespan, down after it drained."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Litestar) -> AsyncIterator[None]:
        await access.start()
        try:
            yield
        finally:
            await access.stop()

    return lifespan


def make_lifespan(
    state: ServerState,
) -> Callable[[Litestar], contextlib.AbstractAsyncContextManager]:
    @contextlib.asynccontextmanager
    async def lifespan(_app: Litestar) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    return lifespan
