"""Tensor- and pipeline-parallel worker processes.

Rank 0 (the driver) runs in the engine's process; ranks 1..N-1 run `_worker_main` in spawned
processes. Every step the driver sends the step payload down a pipe to each worker (msgpack,
see step_payload.py: the SchedulerOutput's changes and the tokens the driver sampled the step
before, O(batch) bytes), runs its own shard, and the layers' all-reduces keep the ranks in
lockstep. Only rank 0 samples. Replies (ready, ok, error) are small and stay pickled.

A draft model or EAGLE head (speculative decoding) lives on the driver alone, whole (draft
TP 1): it proposes from the driver's batch after each step, and its drafts reach the workers
as the next step's spec_token_ids, like n-gram drafts; the workers took part only in
gathering the target's vocabulary shards for an EAGLE head at load.

Pipeline parallelism: world = tensor_parallel_size * pipeline_parallel_size ranks, rank 0 the
first stage's first TP rank (engine.distributed). Every rank still gets every step's payload;
the stages pass hidden states along point to point, and the last stage's first TP rank (the
output rank) samples and sends the step's ModelRunnerOutput back in its reply; the driver
appends those tokens to its own batch and sends them on with the next step, as with TP.
submit() sends a step and runs the driver's stage, collect() waits for the oldest step's
replies: with pipeline_parallel_size P the engine keeps up to P steps submitted
(max_concurrent_batches), each rank running them in order off its pipe.

Devices: on CUDA rank r binds cuda:r (torch.cuda.set_device) before anything touches CUDA,
and the group's backend follows the resolved device (nccl for CUDA, gloo for CPU).

Workers die with their parent: PR_SET_PDEATHSIG on Linux, plus a watchdog thread that
exits when the parent's pid changes (covers other platforms and reparenting races). They
ignore SIGINT and SIGTERM: a Ctrl-C in a terminal or a supervisor's SIGTERM to the whole
process group is the server's to handle (it drains, then stops its workers itself).

A worker that dies takes the engine with it, within a bounded time: a watcher thread waits on
the workers' process sentinels; the driver waits for replies on the pipes and the sentinels
together (never on a pipe alone), and every collective has a timeout
(ParallelConfig.collective_timeout_s), so a peer that died cannot hold the driver in an
all-reduce. Any failed step breaks the group (the ranks' states no longer agree): the group
kills the other workers, and this and every later call raises EngineDeadError.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_ready
from pathlib import Path

import msgspec
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.orphans import die_with_parent, name_process
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.group_failure import GroupFailure
from engine.worker.step_payload import decode_step, encode_step

logger = logging.getLogger("tessera.engine")

_READY_TIMEOUT_S = 600.0  # loading a large model on a slow disk takes a while
_JOIN_TIMEOUT_S = 10.0
_WATCH_S = 0.5  # how often the watcher looks up from the sentinels to see if it should stop
_DEATH_GRACE_S = 1.0  # after a failed step: how long a dying worker gets to be seen as dead
_EXITED = "a tensor-parallel worker exited"


class WorkerExited(RuntimeError):
    """A worker's process ended while the driver waited for its reply."""


_EXECUTE = "execute_model"
# A step for the rank that samples when it is not the driver, with the grammar's bitmask
# (structured outputs), which the engine's process fills: (the step's payload, the mask's
# request ids, its int32 bytes, its shape).
_EXECUTE_MASKED = "execute_model_masked"
_masked_decoder = msgspec.msgpack.Decoder(tuple[msgspec.Raw, list[str], bytes, list[int]])

_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])


def call_message(method: str, body: bytes) -> bytes:
    """One driver -> worker message: a method name and its msgpack-encoded arguments."""
    return _encoder.encode((method, msgspec.Raw(body)))


def step_message(so: SchedulerOutput, prev_sampled: dict[str, list[int]]) -> bytes:
    """The exact bytes a worker gets for one step."""
    return call_message(_EXECUTE, encode_step(so, prev_sampled))


def masked_step_message(so: SchedulerOutput, prev_sampled: dict[str, list[int]]) -> bytes:
    """step_message with the step's grammar bitmask, filled (this waits for it)."""
    import torch

    bitmask = so.grammar_bitmask
    mask = bitmask.result().to("cpu", torch.int32).contiguous()
    body = _encoder.encode(
        (
            msgspec.Raw(encode_step(so, prev_sampled)),
            bitmask.request_ids,
            mask.numpy().tobytes(),
            list(mask.shape),
        )
    )
    return call_message(_EXECUTE_MASKED, body)


def step_messages(
    so: SchedulerOutput, prev_sampled: dict[str, list[int]], ranks: range, output_rank: int
) -> list[bytes]:
    """The message for each of ranks: the same bytes for all, but the rank that samples, if it
    is one of them, gets the grammar's bitmask where the step has one (the driver that samples
    reads the step's own, still filling while its forward runs)."""
    plain = step_message(so, prev_sampled)
    if so.grammar_bitmask is None or output_rank not in ranks:
        return [plain] * len(ranks)
    masked = masked_step_message(so, prev_sampled)
    return [masked if r == output_rank else plain for r in ranks]


def _decode_masked(body) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    import torch

    from engine.structured_output.manager import GrammarBitmask

    step, request_ids, data, shape = _masked_decoder.decode(body)
    so, prev_sampled = decode_step(step)
    done: concurrent.futures.Future = concurrent.futures.Future()
    done.set_result(torch.frombuffer(bytearray(data), dtype=torch.int32).view(shape))
    so.grammar_bitmask = GrammarBitmask(request_ids, done)
    return so, prev_sampled


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def handle_call(runner, message: bytes, answers: bool):
    """Run one driver message on a worker rank's runner (this loop's and the Ray actors',
    engine.worker.ray_executor); the reply's value. A step: the previous step's samples
    first (a rank that samples as rank 0 appended its own), then the step; its output is
    the reply only where `answers` (the rank that samples), else None (rank 0 has it)."""
    method, body = _call_decoder.decode(message)
    if method in (_EXECUTE, _EXECUTE_MASKED):
        so, prev_sampled = decode_step(body) if method == _EXECUTE else _decode_masked(body)
        if not (runner.rank == 0 and runner.samples):
            runner.append_sampled(prev_sampled)
        out = runner.execute_model(so)
        return out if answers else None
    return getattr(runner, method)(*msgspec.msgpack.decode(body))


def _worker_main(
    config: EngineConfig,
    model_dir: Path,
    rank: int,
    world_size: int,
    init_method: str,
    conn: Connection,
    parent_pid: int,
    num_threads: int,
    pp_size: int = 1,
) -> None:
    die_with_parent(parent_pid)
    name_process(f"tessera-tp{rank}")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    import torch

    from engine.distributed import (
        backend_for,
        bind_cuda_device,
        destroy_distributed,
        init_distributed,
    )
    from engine.worker.model_runner import ModelRunner, resolve_device

    torch.set_num_threads(num_threads)
    try:
        device = resolve_device(config.model.device, rank, world_size)
        bind_cuda_device(device)  # first: this rank's context and communicator on its GPU
        timeout_s = config.parallel.collective_timeout_s
        conn.send(("joining", None))  # imported: the driver joins the group only now
        init_distributed(rank, world_size, init_method, backend_for(device), timeout_s, pp_size)
        runner = ModelRunner(config, model_dir=model_dir, rank=rank)
        # Under pipeline parallelism the rank that samples answers with the step's output.
        answers = runner.samples and pp_size > 1
        runner.load_model()
        conn.send(("ready", None))
        while True:
            message = conn.recv_bytes()
            if _call_decoder.decode(message)[0] == "stop":
                break
            conn.send(("ok", handle_call(runner, message, answers)))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # report, then die: the driver turns it into an error
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            destroy_distributed()


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class WorkerGroup:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        import torch

        from engine.distributed import backend_for, bind_cuda_device, init_distributed
        from engine.worker.model_runner import ModelRunner, resolve_device

        world_size = config.parallel.world_size
        self.pp_size = pp_size = config.parallel.pipeline_parallel_size
        # The rank whose reply carries the step's output (pipeline parallel): the last
        # stage's first TP rank; rank 0 itself without pipeline parallelism.
        self.output_rank = (pp_size - 1) * config.parallel.tensor_parallel_size
        # Resolved here first: too few GPUs fails before any process starts.
        self.device = resolve_device(config.model.device, 0, world_size)
        self.backend = backend_for(self.device)
        self.timeout_s = config.parallel.collective_timeout_s
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # Each rank computes at once: split the cores this process may use (its affinity,
        # which the workers inherit) instead of oversubscribing them.
        num_threads = max(1, usable_cpus() // world_size)
        self._dead = GroupFailure("The tensor-parallel group")  # why it broke; set once
        self._lock = self._dead.lock  # also guards the processes' reaping
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        ctx = mp.get_context("spawn")
        self.procs: list = []
        self.conns: list[Connection] = []
        for rank in range(1, world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(
                    config,
                    model_dir,
                    rank,
                    world_size,
                    init_method,
                    child_conn,
                    os.getpid(),
                    num_threads,
                    pp_size,
                ),
                name=f"tessera-tp{rank}",
                daemon=True,
            )
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
        # What the driver sampled last step: the workers append it before the next one.
        self._sampled: dict[str, list[int]] = {}
        self._driver_results: list[ModelRunnerOutput] = []  # the steps submitted, in order
        try:
            # Every rank at the rendezvous within moments of the others, however long the
            # workers took to start: the collective timeout need not cover an import.
            self._gather(timeout=_READY_TIMEOUT_S)
            bind_cuda_device(self.device)
            torch.set_num_threads(num_threads)
            init_distributed(0, world_size, init_method, self.backend, self.timeout_s, pp_size)
            self.driver = ModelRunner(config, model_dir=model_dir, rank=0)
            self.driver.load_model()
            self._gather(timeout=_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="tessera-tp-watch", daemon=True)
        self._watcher.start()
        logger.info(
            "Tensor parallel %d x pipeline parallel %d: %d ranks ready (%s, collective "
            "timeout %.0f s)",
            config.parallel.tensor_parallel_size,
            pp_size,
            world_size,
            self.backend,
            self.timeout_s,
        )

    # -- liveness -------------------------------------------------------------------------

    @property
    def failure(self) -> str | None:
        """Why the group is dead, or None while it is alive."""
        return self._dead.cause

    def add_failure_callback(self, callback: Callable[[EngineDeadError], None]) -> None:
        """Call callback(error) once when the group dies (from the thread that notices)."""
        self._dead.add_listener(callback)

    def check_alive(self) -> None:
        """Raise EngineDeadError if the group broke or a worker has exited."""
        self._dead.raise_if_dead()
        if wait_ready([p.sentinel for p in self.procs], timeout=0):
            raise self._fail(_EXITED)

    def _watch(self) -> None:
        """Notice a worker's death even while the driver is busy or idle."""
        sentinels = [p.sentinel for p in self.procs]
        while not self._closing.is_set():
            if wait_ready(sentinels, timeout=_WATCH_S) and not self._closing.is_set():
                self._fail(_EXITED, read_pipes=False)
                return

    def _fail(self, cause: str, read_pipes: bool = True) -> EngineDeadError:
        """Mark the group dead (the first reason wins), kill the workers left, tell the
        callbacks; returns the error to raise. read_pipes: look for a worker's error reply
        (only on the thread that drives the group: the pipes are not shared)."""

        def describe() -> str:
            # The workers that exited, then what failed (a worker's own error says why).
            reasons = self._deaths(_DEATH_GRACE_S)
            if read_pipes:
                reasons += self._pending_errors()
            if cause != _EXITED or not reasons:
                reasons.append(cause)
            return "; ".join(reasons)

        return self._dead.fail(describe, self._kill_workers)

    def _deaths(self, grace: float) -> list[str]:
        """The workers that exited (waiting up to grace for the first), as sentences."""
        ended = set(wait_ready([p.sentinel for p in self.procs], timeout=grace))
        out = []
        for rank, proc in enumerate(self.procs, start=1):
            if proc.sentinel in ended:
                # Its pipes close a moment before it can be reaped: wait for that moment.
                proc.join(_DEATH_GRACE_S)
            code = proc.exitcode
            if code is not None:
                verb = "exited" if code == 0 else "died"
                what = describe_exit(code)
                out.append(f"tensor-parallel worker rank {rank} (pid {proc.pid}) {verb} ({what})")
        return out

    def _pending_errors(self) -> list[str]:
        """The error replies waiting in the pipes (a worker that failed says why first)."""
        out = []
        for conn in self.conns:
            with contextlib.suppress(Exception):
                while conn.poll():
                    status, value = conn.recv()
                    if status == "error":
                        out.append(f"tensor-parallel worker failed: {value}")
        return out

    def _kill_workers(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(2)

    # -- calls ----------------------------------------------------------------------------

    def _gather(self, timeout: float) -> list:
        """Every worker's reply, waiting on the pipe and every worker's sentinel at once."""
        deadline = time.monotonic() + timeout
        sentinels = [p.sentinel for p in self.procs]
        results = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll():
                self._dead.raise_if_dead()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(
                        f"tensor-parallel worker rank {rank} did not answer in {timeout:.0f} s"
                    )
                ready = wait_ready([conn, *sentinels], timeout=left)
                if ready and conn not in ready:
                    with self._lock:
                        deaths = self._deaths(0)
                    raise WorkerExited("; ".join(deaths) or _EXITED)
            try:
                status, value = conn.recv()
            except EOFError:
                raise WorkerExited(f"tensor-parallel worker rank {rank} died") from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker failed: {value}")
            results.append(value)
        return results

    def _call(self, method: str, *args):
        """Run a set-up method on every rank. A failure (a model too big for the KV budget,
        say) keeps its own type, but the group is done: its workers are stopped."""
        self.check_alive()
        try:
            self._send(call_message(method, _encoder.encode(args)))
            result = getattr(self.driver, method)(*args)
            return result, self._gather(self.timeout_s)
        except Exception as exc:
            self._fail(f"{method} failed: {type(exc).__name__}: {exc}")
            raise

    def _send(self, message: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(message)

    def stage_stats(self) -> list:
        """Every rank's StageStats, rank 0 first (between steps: none in flight)."""
        mine, theirs = self._call("stage_stats")
        return [mine, *theirs]

    def determine_num_blocks(self) -> int:
        mine, theirs = self._call("determine_num_blocks")
        return min([mine, *theirs])

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks)

    @property
    def max_concurrent_batches(self) -> int:
        """Steps submitted before the oldest is collected: one per pipeline stage (the first
        stage computes batch k+1 while the later ones compute batch k); 1 without PP."""
        return self.pp_size

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.submit(scheduler_output)
        return self.collect()

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Send a step to every rank and run the driver's share (under PP its stage, which
        hands the batch on to the next); collect() returns its output. Steps are collected
        in the order submitted: every rank and stage runs them in that order."""
        self.check_alive()
        try:
            ranks = range(1, len(self.conns) + 1)
            messages = step_messages(scheduler_output, self._sampled, ranks, self.output_rank)
            for conn, message in zip(self.conns, messages, strict=True):
                conn.send_bytes(message)
            self._sampled = {}  # sent: never twice, even if this step fails
            self._driver_results.append(self.driver.execute_model(scheduler_output))
        except Exception as exc:
            raise self._step_failed(exc) from exc

    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output, once every rank has answered for it."""
        try:
            result = self._driver_results.pop(0)
            replies = self._gather(self.timeout_s)
            if self.output_rank:  # the last stage sampled: its output, in the driver's batch
                result = replies[self.output_rank - 1]
                self.driver.append_sampled(result.sampled_token_ids)
        except Exception as exc:
            raise self._step_failed(exc) from exc
        self._sampled.update((rid, t) for rid, t in result.sampled_token_ids.items() if t)
        return result

    def _step_failed(self, exc: Exception) -> EngineDeadError:
        if isinstance(exc, EngineDeadError):
            return exc
        if isinstance(exc, WorkerExited):
            return self._fail(_EXITED)
        # a rank failed mid-step: the ranks no longer agree
        return self._fail(f"a tensor-parallel step failed: {type(exc).__name__}: {exc}")

    def shutdown(self) -> None:
        self._closing.set()
        with self._lock:
            if self._dead.cause is None:
                for conn in self.conns:
                    with contextlib.suppress(Exception):
                        conn.send_bytes(call_message("stop", _encoder.encode(())))
                deadline = time.monotonic() + _JOIN_TIMEOUT_S
                for proc in self.procs:
                    proc.join(max(0.1, deadline - time.monotonic()))
            self._kill_workers()
            failed = self._dead.cause is not None
        if self._watcher is not None:
            self._watcher.join(2 * _WATCH_S)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        # NCCL after a peer died may block in its teardown; the process is about to exit.
        if not (failed and self.backend == "nccl"):
            with contextlib.suppress(Exception):
                from engine.distributed import destroy_distributed

                destroy_distributed()
