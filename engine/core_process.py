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
import os
import queue
import signal
import threading
from collections.abc import Callable
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
    config: EngineConfig, commands, results, child_init: Callable | None, parent_pid: int
) -> None:
    """The child process: load the engine, tell the parent, then run the step loop. It dies
    with the parent, and leaves SIGINT / SIGTERM to it (a Ctrl-C reaches the whole process
    group: the parent drains, then tells the child to stop)."""
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
        results.send(("failed", _picklable(exc)))
        return
    results.send(("ready", CoreFacts.of(engine)))
    # The model and the imports are long-lived: full collections would walk them every time.
    gc.collect()
    gc.freeze()
    CoreLoop(engine, commands, results).run()


class CoreLoop:
    """The child's step loop: AsyncEngine's, with a pipe on each side."""

    def __init__(self, engine, commands, results) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self._send_lock = threading.Lock()  # grammar compiles answer from their own thread
        self._stop = False
        self._dead: str | None = None
        self._deltas = DeltaEncoder()  # outputs are sent from this loop's thread only, in order
        engine.executor.on_dead(self._worker_died)

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.results.send(message)

    def _worker_died(self, exc: EngineDeadError) -> None:
        self._dead = str(exc)

    def run(self) -> None:
        engine = self.engine
        try:
            self.send(("stats", engine_stats(engine)))
            while not self._stop and self._dead is None:
                busy = engine.has_unfinished_requests()
                if self._drain(block=not busy):
                    self.send(("stats", engine_stats(engine)))
                if self._stop or not engine.has_unfinished_requests():
                    continue
                outputs = step_or_fail(engine)
                self.send(("outputs", self._deltas.encode(outputs), engine_stats(engine)))
            if self._dead is not None:
                self.send(("dead", self._dead))
        except EngineDeadError as exc:
            self.send(("dead", str(exc)))
        except (BrokenPipeError, EOFError, OSError):
            pass  # the parent is gone
        except BaseException as exc:
            logger.exception("Engine loop died")
            with contextlib.suppress(Exception):
                self.send(("dead", f"The engine loop died: {type(exc).__name__}: {exc}"))
        finally:
            engine.shutdown()

    def _drain(self, block: bool) -> bool:
        """Handle every command waiting (one wait first where idle); True if there was any."""
        if not self.commands.poll(_IDLE_POLL_S if block else 0):
            return False
        while True:
            try:
                item = self.commands.recv()
            except EOFError:  # the parent is gone
                self._stop = True
                return True
            self._handle(item)
            if self._stop or not self.commands.poll(0):
                return True

    def _handle(self, item: tuple) -> None:
        kind, engine = item[0], self.engine
        if kind == "add":
            request = item[1]
            try:
                engine.add(request)
            except Exception as exc:  # admitted already: a grammar that failed, say
                self.send(("fail_one", request.request_id, _picklable(exc)))
        elif kind == "abort":  # ("abort", request id, token of an abort that waits or None)
            out = engine.abort_request(item[1])
            if out is not None:
                self.send(("outputs", self._deltas.encode([out]), engine_stats(engine)))
            if item[2] is not None:  # after its output: the parent has it when this resolves
                self.send(("reply", item[2], None))
        elif kind == "snapshot":
            self.send(("reply", item[1], request_infos(engine)))
        elif kind == "blocks":
            manager = engine.scheduler.kv_cache_manager
            self.send(("reply", item[1], bytes(manager.block_states())))
        elif kind == "compile":
            token = item[1]
            try:
                future = engine.structured.compile(item[2])
            except Exception as exc:  # a size limit: at once
                self.send(("reply", token, str(exc)))
                return
            future.add_done_callback(
                lambda f: self.send(("reply", token, str(f.exception()) if f.exception() else None))
            )
        elif kind == "shutdown":
            self._stop = True


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
        cls, config: EngineConfig, child_init: Callable | None = None, **kwargs
    ) -> ProcessEngine:
        """Start the child and wait until it has loaded (a load that fails raises here, the
        child gone); child_init (picklable): run first in the child (the server's logging)."""
        ctx = multiprocessing.get_context("spawn")
        commands_in, commands_out = ctx.Pipe(duplex=False)
        results_in, results_out = ctx.Pipe(duplex=False)
        # Not a daemon: the child starts tensor-parallel workers of its own.
        proc = ctx.Process(
            target=core_main,
            args=(config, commands_in, results_out, child_init, os.getpid()),
            name="tessera-engine-core",
        )
        proc.start()
        commands_in.close()
        results_out.close()
        try:
            kind, value = await asyncio.to_thread(_first_message, results_in, proc)
            if kind == "failed":
                raise value
            facts: CoreFacts = value
            from engine.llm_engine import engine_tokenizer

            facts.tokenizer = await asyncio.to_thread(
                engine_tokenizer, facts.config, facts.model_dir, facts.hf_config
            )
        except BaseException:  # failed (the child is ending) or cancelled (it may be loading)
            _stop(proc, 2.0)
            raise
        for conn in (commands_out, results_in):  # a step's outputs in the pipe, not waiting
            _widen_pipe(conn)
        engine = cls(facts, **kwargs)
        engine._proc = proc
        engine._results = results_in
        engine._child_dead = None  # why the child said it dies, if it could
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
        self._stopping.set()
        self._outbox.put(("shutdown",))
        self._outbox.close()
        await asyncio.to_thread(_stop, self._proc, 30.0)
        self._on_readable()  # the rest, then the end of the pipe: the streams end

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
        self._proc.join(0.5)
        dead = self._child_dead
        if dead is None and not self._stopping.is_set():
            dead = f"the engine process exited (exit code {self._proc.exitcode})"
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


def _first_message(results, proc) -> tuple[str, Any]:
    """("ready", CoreFacts) or ("failed", exception); a child that exits first fails."""
    while not results.poll(0.5):
        if not proc.is_alive():
            return "failed", EngineDeadError(
                f"the engine process exited while loading (exit code {proc.exitcode})"
            )
    try:
        return results.recv()
    except EOFError:
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
