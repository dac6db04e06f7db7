"""The engine core in a process of its own: the server's event loop and the engine's step loop
stop sharing one GIL (vLLM's AsyncLLM / EngineCore split).

    engine = await ProcessEngine.create(config)    # an EngineClient, as AsyncEngine

In one process the event loop (a streamed token's SSE chunk through the ASGI stack) and the
engine thread (scheduling, sampling, detokenizing) take turns on one GIL: on a small model at
hundreds of streams the server streamed a third of what the same engine makes offline
(BENCHMARKS.md, `tessera bench frontend`). Here the child process builds the LLMEngine (the
model, the executor and its workers) and runs the step loop (CoreLoop): between steps it reads
the commands the parent sends (add, abort, a snapshot, the block map, a grammar to compile,
shutdown), steps, and sends each step's outputs with the engine's stats in one message (as
what they add: engine.output_delta, the prompt once and then each step's new tokens). The
parent is AsyncEngine's front half: the per-request streams, the checks a request passes
before its first await (engine.request_checks, over the facts the child sent once it loaded:
CoreFacts), a thread that sends the commands (the event loop never blocks on a full pipe),
and the event loop itself reading the child's messages (a reader on the pipe: no thread taking
turns with it on the GIL), each step's outputs dispatched to the streams as they arrive.

A child that dies (a crash, a lost tensor-parallel worker, a kill) is heard at once (the
pipe's end of file): the engine is dead for good, every stream fails, and the server exits
non-zero. A parent that dies takes the child with it (engine.orphans.die_with_parent).

Several clients (`--api-server-count`, api/server/api_servers.py): the parent hands the child
the core's ends of other API server processes' channels (`create(peers=...)`, made with
`core_channel()`), and each of those processes `attach`es through its own ends. The child
sends each client its own requests' outputs and every client the engine's stats; a client
other than the parent that goes (or shuts down: a detach) has its requests aborted, and the
parent's going stops the core.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import AsyncEngine, engine_stats, request_infos, step_or_fail
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.lora.request import LoRARequest
from engine.orphans import die_with_parent, name_process
from engine.output_delta import DeltaDecoder, DeltaEncoder
from engine.request_checks import RequestChecks
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import GrammarError

logger = logging.getLogger("tessera.engine")

_IDLE_POLL_S = 0.2  # how often an idle child checks its pipe


@dataclass
class CoreFacts(RequestChecks):
    """What the parent knows of the loaded engine (sent by the child once): what a request is
    checked against, what a server reads, and the tokenizer (loaded in the parent)."""

    config: EngineConfig
    model_dir: str
    max_model_len: int
    vocab_size: int
    hf_config: Any
    runner: str
    sampling_defaults: dict
    base_quantization: str | None
    num_blocks: int
    compile_timeout_s: float
    tokenizer: Any = None
    _adapters: dict[int, LoRARequest] = field(default_factory=dict)

    @classmethod
    def of(cls, engine) -> CoreFacts:
        return cls(
            config=engine.config,
            model_dir=str(engine.model_dir),
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            hf_config=engine.hf_config,
            runner=engine.runner,
            sampling_defaults=engine.sampling_defaults,
            base_quantization=engine.base_quantization,
            num_blocks=engine.num_blocks,
            compile_timeout_s=engine.structured.limits.compile_timeout_s,
        )


def _picklable(exc: BaseException) -> BaseException:
    """exc if it survives a pipe, else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any failure: its text will do
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def core_main(
    config: EngineConfig, channels: list[tuple], child_init: Callable | None, parent_pid: int
) -> None:
    """The child process: load the engine, tell every client, then run the step loop. It dies
    with the parent, and leaves SIGINT / SIGTERM to it (a Ctrl-C reaches the whole process
    group: the parent drains, then tells the child to stop). `channels`: (commands, results)
    a client, the parent's first (further ones: other API server processes, --api-server-count)."""
    die_with_parent(parent_pid)
    name_process("tessera-core")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    if child_init is not None:
        child_init()  # the server's logging, say
    from engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # noqa: BLE001 - handed to create()'s caller
        failed = ("failed", _picklable(exc))
        for _, results in channels:
            with contextlib.suppress(OSError):
                results.send(failed)
        return
    facts = CoreFacts.of(engine)
    for _, results in channels:
        with contextlib.suppress(OSError):  # a client that died meanwhile: the loop drops it
            results.send(("ready", facts))
    # The model and the imports are long-lived: full collections would walk them every time.
    gc.collect()
    gc.freeze()
    CoreLoop(engine, channels).run()


@dataclass(eq=False)
class _Client:
    """One API server's pipes to the core, what its requests were sent so far, and which of
    its requests are in the engine."""

    commands: Any
    results: Any
    deltas: DeltaEncoder = field(default_factory=DeltaEncoder)
    requests: set[str] = field(default_factory=set)


class CoreLoop:
    """The child's step loop: AsyncEngine's, with a pipe on each side, for one or more clients
    (API server processes). Each request's outputs go to the client that added it; the
    engine's stats to every client. The first client is the parent, which owns the core: when
    it goes, the core stops; another client that goes (or detaches) has its requests aborted."""

    def __init__(self, engine, channels: list[tuple]) -> None:
        self.engine = engine
        self.clients = [_Client(commands, results) for commands, results in channels]
        self._owner_of: dict[str, _Client] = {}  # request id -> the client that added it
        self._broken: set[_Client] = set()  # clients whose pipe broke, to drop
        self._send_lock = threading.Lock()  # grammar compiles answer from their own thread
        self._stop = False
        self._dead: str | None = None
        engine.executor.on_dead(self._worker_died)

    def send(self, client: _Client, message: tuple) -> None:
        """To one client; a client other than the parent whose pipe broke is dropped by the
        loop (this may run on a grammar compile's thread)."""
        try:
            with self._send_lock:
                client.results.send(message)
        except (BrokenPipeError, OSError):
            if client is self.clients[0]:
                raise  # the parent is gone: run() ends
            self._broken.add(client)

    def broadcast(self, message: tuple) -> None:
        for client in list(self.clients):
            self.send(client, message)

    def _worker_died(self, exc: EngineDeadError) -> None:
        self._dead = str(exc)

    def run(self) -> None:
        engine = self.engine
        try:
            self.broadcast(("stats", engine_stats(engine)))
            while not self._stop and self._dead is None:
                for client in list(self._broken):
                    self._drop(client)
                busy = engine.has_unfinished_requests()
                if self._drain(block=not busy):
                    self.broadcast(("stats", engine_stats(engine)))
                if self._stop or not engine.has_unfinished_requests():
                    continue
                self._send_outputs(step_or_fail(engine))
            if self._dead is not None:
                self.broadcast(("dead", self._dead))
        except EngineDeadError as exc:
            self.broadcast(("dead", str(exc)))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the parent is gone
        except BaseException as exc:
            logger.exception("Engine loop died")
            with contextlib.suppress(Exception):
                self.broadcast(("dead", f"The engine loop died: {type(exc).__name__}: {exc}"))
        finally:
            engine.shutdown()

    def _send_outputs(self, outputs: list) -> None:
        """Each client its requests' outputs (as deltas) with the stats; the others the stats."""
        stats = engine_stats(self.engine)
        mine: dict[_Client, list] = {}
        for out in outputs:
            client = self._owner_of.get(out.request_id)
            if client is None:
                continue  # a dropped client's request, ended meanwhile
            mine.setdefault(client, []).append(out)
            if out.finished:
                del self._owner_of[out.request_id]
                client.requests.discard(out.request_id)
        for client in list(self.clients):
            outs = mine.get(client)
            message = ("outputs", client.deltas.encode(outs), stats) if outs else ("stats", stats)
            self.send(client, message)

    def _drain(self, block: bool) -> bool:
        """Handle every command waiting (one wait first where idle); True if there was any."""
        by_pipe = {client.commands: client for client in self.clients}
        ready = multiprocessing.connection.wait(list(by_pipe), _IDLE_POLL_S if block else 0)
        for pipe in ready:
            client = by_pipe[pipe]
            while client in self.clients and not self._stop:
                try:
                    item = pipe.recv()
                except (EOFError, OSError):  # the client is gone
                    self._gone(client)
                    break
                self._handle(client, item)
                if client not in self.clients or not pipe.poll(0):  # dropped: its pipes closed
                    break
        return bool(ready)

    def _gone(self, client: _Client) -> None:
        if client is self.clients[0]:
            self._stop = True  # the parent owns the core
        else:
            self._drop(client)

    def _drop(self, client: _Client) -> None:
        """A client other than the parent left: abort what it still runs, forget it."""
        self._broken.discard(client)
        if client not in self.clients:
            return
        logger.info(
            "An API server left the engine: %d request(s) of it aborted", len(client.requests)
        )
        self.clients.remove(client)
        for request_id in list(client.requests):
            self._owner_of.pop(request_id, None)
            self.engine.abort_request(request_id)
        client.requests.clear()
        for pipe in (client.commands, client.results):
            with contextlib.suppress(OSError):
                pipe.close()

    def _handle(self, client: _Client, item: tuple) -> None:
        kind, engine = item[0], self.engine
        if kind == "add":
            request = item[1]
            rid = request.request_id
            if rid in self._owner_of:  # ids are random: only a broken client repeats one
                self.send(client, ("fail_one", rid, ValueError(f"request id {rid!r} in use")))
                return
            self._owner_of[rid] = client
            client.requests.add(rid)
            try:
                engine.add(request)
            except Exception as exc:  # admitted already: a grammar that failed, say
                del self._owner_of[rid]
                client.requests.discard(rid)
                self.send(client, ("fail_one", rid, _picklable(exc)))
        elif kind == "abort":  # ("abort", request id, token of an abort that waits or None)
            if self._owner_of.get(item[1]) in (client, None):  # never another client's
                out = engine.abort_request(item[1])
                if out is not None:
                    self._send_outputs([out])
            if item[2] is not None:  # after its output: the parent has it when this resolves
                self.send(client, ("reply", item[2], None))
        elif kind == "snapshot":
            self.send(client, ("reply", item[1], request_infos(engine)))
        elif kind == "blocks":
            manager = engine.scheduler.kv_cache_manager
            self.send(client, ("reply", item[1], bytes(manager.block_states())))
        elif kind == "compile":
            token = item[1]
            try:
                future = engine.structured.compile(item[2])
            except Exception as exc:  # a size limit: at once
                self.send(client, ("reply", token, str(exc)))
                return
            future.add_done_callback(
                lambda f: self.send(
                    client, ("reply", token, str(f.exception()) if f.exception() else None)
                )
            )
        elif kind == "shutdown":
            self._gone(client)  # the parent's stops the core; another's is a detach


class _Outbox:
    """AsyncEngine's inbox, for a child: put() queues a command for the sending thread (the
    event loop never waits on a full pipe); a command that waits for an answer (a snapshot,
    the block map, a compile, an abort that waits) carries a token in place of its future,
    resolved by the reply."""

    def __init__(self, commands) -> None:
        self.commands = commands
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._tokens = itertools.count()
        self.pending: dict[int, concurrent.futures.Future] = {}
        self._thread = threading.Thread(target=self._send, name="tessera-core-send", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        if item[0] in ("snapshot", "blocks"):
            item = (item[0], self._register(item[1]))
        elif item[0] == "abort" and item[2] is not None:  # an abort that waits for its ack
            item = (item[0], item[1], self._register(item[2]))
        self._queue.put(item)

    def ask(self, kind: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((kind, self._register(future), *args))
        return future

    def _register(self, future: concurrent.futures.Future) -> int:
        token = next(self._tokens)
        self.pending[token] = future
        return token

    def resolve(self, token: int, value: Any) -> None:
        future = self.pending.pop(token, None)
        if future is not None and not future.done():
            future.set_result(value)

    def fail_pending(self, exc: BaseException) -> None:
        for future in list(self.pending.values()):
            if not future.done():
                future.set_exception(exc)
        self.pending.clear()

    def close(self) -> None:
        self._queue.put(None)

    def _send(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self.commands.send(item)
            except (BrokenPipeError, OSError):  # the child is gone: the receiver says so
                return


class ProcessEngine(AsyncEngine):
    """An EngineClient whose engine runs in a child process (see the module doc)."""

    @classmethod
    async def create(
        cls,
        config: EngineConfig,
        child_init: Callable | None = None,
        peers: Sequence[tuple] = (),
        **kwargs,
    ) -> ProcessEngine:
        """Start the child and wait until it has loaded (a load that fails raises here, the
        child gone); child_init (picklable): run first in the child (the server's logging).
        `peers`: the core's ends of other API servers' channels (core_channel()), handed to
        the child and closed here; those servers `attach` through their ends."""
        ctx = multiprocessing.get_context("spawn")
        core_ends, (commands_out, results_in) = core_channel()
        try:
            # Not a daemon: the child starts tensor-parallel workers of its own.
            proc = ctx.Process(
                target=core_main,
                args=(config, [core_ends, *peers], child_init, os.getpid()),
                name="tessera-engine-core",
            )
            proc.start()
        finally:  # the child has its copies (or there is no child: the peers see an end)
            for conn in (*core_ends, *(end for peer in peers for end in peer)):
                conn.close()
        try:
            return await cls._connect(proc, commands_out, results_in, kwargs)
        except BaseException:  # failed (the child is ending) or cancelled (it may be loading)
            _stop(proc, 2.0)
            raise

    @classmethod
    async def attach(cls, channel: tuple, **kwargs) -> ProcessEngine:
        """A client of a core another process started (an API server of several): `channel`
        is this side's ends of a core_channel() the core was given. Waits until the core has
        loaded; raises what its load failed with."""
        commands_out, results_in = channel
        try:
            return await cls._connect(None, commands_out, results_in, kwargs)
        except BaseException:
            commands_out.close()
            results_in.close()
            raise

    @classmethod
    async def _connect(cls, proc, commands_out, results_in, kwargs: dict) -> ProcessEngine:
        kind, value = await asyncio.to_thread(_first_message, results_in, proc)
        if kind == "failed":
            raise value
        facts: CoreFacts = value
        from engine.llm_engine import engine_tokenizer

        facts.tokenizer = await asyncio.to_thread(
            engine_tokenizer, facts.config, facts.model_dir, facts.hf_config
        )
        for conn in (commands_out, results_in):  # a step's outputs in the pipe, not waiting
            _widen_pipe(conn)
        engine = cls(facts, **kwargs)
        engine._proc = proc  # None: another process's core (attach)
        engine._results = results_in
        engine._child_dead = None  # why the child said it dies, if it could
        engine._gone = asyncio.Event()  # the child's pipe closed
        engine._inbox = engine._outbox = _Outbox(commands_out)
        engine._deltas = DeltaDecoder()
        engine._loop = loop = asyncio.get_running_loop()
        # The event loop reads the child's messages itself (no thread taking turns with it
        # on the GIL): each step's outputs reach the streams in the loop turn they arrive.
        loop.add_reader(results_in.fileno(), engine._on_readable)
        # uvloop makes a reader's fd non-blocking; a message is read whole once it starts
        os.set_blocking(results_in.fileno(), True)
        return engine

    def _running(self) -> bool:
        if self._proc is None:
            return not self._gone.is_set()
        return self._proc.is_alive()

    async def compile_grammar(self, so: StructuredOutputsParams) -> None:
        """Compiled (or found cached) in the child; GrammarError as AsyncEngine's."""
        limit = self.engine.compile_timeout_s
        future = self._outbox.ask("compile", so)
        try:
            error = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), limit)
        except TimeoutError:
            raise GrammarError(
                f"the grammar took longer than {limit:g} s to compile; simplify it"
            ) from None
        if error is not None:
            raise GrammarError(error)

    async def shutdown(self) -> None:
        """The parent's stops the child; an attached client's detaches (the core goes on
        for the others and closes this client's pipes)."""
        self._stopping.set()
        self._outbox.put(("shutdown",))
        self._outbox.close()
        if self._proc is not None:
            await asyncio.to_thread(_stop, self._proc, 30.0)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._gone.wait(), 10.0)
        self._on_readable()  # the rest, then the end of the pipe: the streams end
        if not self._gone.is_set():  # a core that did not answer the detach
            self._child_gone()

    def _on_readable(self) -> None:
        """On the event loop: every message the child has sent, until its pipe closes."""
        if self._results.closed:
            return
        try:
            while self._results.poll():
                message = self._results.recv()
                kind = message[0]
                if kind == "outputs":
                    self._stats = message[2]
                    self._dispatch(self._deltas.decode(message[1]))
                elif kind == "stats":
                    self._stats = message[1]
                elif kind == "reply":
                    self._outbox.resolve(message[1], message[2])
                elif kind == "fail_one":
                    self._fail_one(message[1], message[2])
                elif kind == "dead":
                    self._child_dead = message[1]
        except (EOFError, OSError):
            self._child_gone()

    def _child_gone(self) -> None:
        """The child's end of the pipe closed: it stopped (a shutdown) or died."""
        self._loop.remove_reader(self._results.fileno())
        self._results.close()
        self._gone.set()
        dead = self._child_dead
        if self._proc is not None:
            self._proc.join(0.5)
            if dead is None and not self._stopping.is_set():
                dead = f"the engine process exited (exit code {self._proc.exitcode})"
        elif dead is None and not self._stopping.is_set():
            dead = "the engine process closed its pipe (it stopped or died)"
        error = EngineDeadError(dead or "The engine stopped.")
        self._outbox.fail_pending(error)
        self._stats = dataclasses.replace(self._stats, loop_alive=False)
        if dead is not None:
            self._mark_dead(error)
        else:  # a shutdown: the streams still open end too
            self._fail_all(error)


def _widen_pipe(conn) -> None:
    """A pipe of 1 MiB (Linux; the default 64 KiB holds half a 256-request step's outputs),
    so the child's send of a step does not wait for the parent's read."""
    with contextlib.suppress(Exception):
        import fcntl

        fcntl.fcntl(conn.fileno(), 1031, 1 << 20)  # F_SETPIPE_SZ


def core_channel() -> tuple[tuple, tuple]:
    """Two one-way pipes between the core and one client: (the core's ends: commands to read,
    results to write; the client's ends: commands to write, results to read)."""
    ctx = multiprocessing.get_context("spawn")
    commands_in, commands_out = ctx.Pipe(duplex=False)
    results_in, results_out = ctx.Pipe(duplex=False)
    return (commands_in, results_out), (commands_out, results_in)


def _first_message(results, proc) -> tuple[str, Any]:
    """("ready", CoreFacts) or ("failed", exception); a child that exits first fails (proc
    None: another process's core, whose end of the pipe closes if it does)."""
    while not results.poll(0.5):
        if proc is not None and not proc.is_alive():
            return "failed", EngineDeadError(
                f"the engine process exited while loading (exit code {proc.exitcode})"
            )
    try:
        return results.recv()
    except EOFError:
        if proc is None:
            return "failed", EngineDeadError("the engine process exited while loading")
        proc.join(5)
        return "failed", EngineDeadError(
            f"the engine process exited while loading (exit code {proc.exitcode})"
        )


def _stop(proc, timeout: float = 10.0) -> None:
    """Wait for the child to end, then make it (terminate, then kill)."""
    proc.join(timeout)
    if proc.is_alive():
        proc.terminate()
        proc.join(5)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
