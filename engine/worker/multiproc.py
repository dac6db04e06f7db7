"""Tensor-parallel worker processes.

Rank 0 (the driver) runs in the engine's process; ranks 1..N-1 run `_worker_main` in spawned
processes. Every step the driver sends the step payload down a pipe to each worker (msgpack,
see step_payload.py: the SchedulerOutput's changes and the tokens the driver sampled the step
before, O(batch) bytes), runs its own shard, and the layers' all-reduces keep the ranks in
lockstep. Only rank 0 samples. Replies (ready, ok, error) are small and stay pickled.

Workers die with their parent: PR_SET_PDEATHSIG on Linux, plus a watchdog thread that
exits when the parent's pid changes (covers other platforms and reparenting races).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.outputs import ModelRunnerOutput, SchedulerOutput
from engine.worker.step_payload import decode_step, encode_step

logger = logging.getLogger("tessera.engine")

_READY_TIMEOUT_S = 600.0  # loading a large model on a slow disk takes a while
_JOIN_TIMEOUT_S = 10.0
_EXECUTE = "execute_model"

_encoder = msgspec.msgpack.Encoder()
_call_decoder = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])


def call_message(method: str, body: bytes) -> bytes:
    """One driver -> worker message: a method name and its msgpack-encoded arguments."""
    return _encoder.encode((method, msgspec.Raw(body)))


def step_message(so: SchedulerOutput, prev_sampled: dict[str, list[int]]) -> bytes:
    """The exact bytes a worker gets for one step."""
    return call_message(_EXECUTE, encode_step(so, prev_sampled))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watchdog() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watchdog, daemon=True, name="parent-watchdog").start()


def _worker_main(
    config: EngineConfig,
    model_dir: Path,
    rank: int,
    world_size: int,
    init_method: str,
    conn: Connection,
    parent_pid: int,
    num_threads: int,
) -> None:
    _die_with_parent(parent_pid)
    import torch

    from engine.distributed import destroy_distributed, init_distributed
    from engine.worker.model_runner import ModelRunner

    torch.set_num_threads(num_threads)
    try:
        init_distributed(rank, world_size, init_method, _backend(config))
        runner = ModelRunner(config, model_dir=model_dir, rank=rank)
        runner.load_model()
        conn.send(("ready", None))
        while True:
            method, body = _call_decoder.decode(conn.recv_bytes())
            if method == "stop":
                break
            if method == _EXECUTE:
                so, prev_sampled = decode_step(body)
                runner.append_sampled(prev_sampled)
                runner.execute_model(so)
                conn.send(("ok", None))  # the step's result lives on rank 0
                continue
            conn.send(("ok", getattr(runner, method)(*msgspec.msgpack.decode(body))))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as exc:  # report, then die: the driver turns it into an error
        with contextlib.suppress(Exception):
            conn.send(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))
    finally:
        with contextlib.suppress(Exception):
            destroy_distributed()


def _backend(config: EngineConfig) -> str:
    return "nccl" if config.model.device == "cuda" else "gloo"


class WorkerGroup:
    def __init__(self, config: EngineConfig, model_dir: Path) -> None:
        import torch

        from engine.distributed import init_distributed
        from engine.worker.model_runner import ModelRunner

        world_size = config.parallel.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_port()}"
        # Each rank computes at once: split the cores instead of oversubscribing them.
        num_threads = max(1, (os.cpu_count() or 1) // world_size)
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
        try:
            torch.set_num_threads(num_threads)
            init_distributed(0, world_size, init_method, _backend(config))
            self.driver = ModelRunner(config, model_dir=model_dir, rank=0)
            self.driver.load_model()
            self._gather(timeout=_READY_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("Tensor parallel: %d ranks ready", world_size)

    def _gather(self, timeout: float | None = None) -> list:
        results = []
        for rank, conn in enumerate(self.conns, start=1):
            if timeout is not None and not conn.poll(timeout):
                raise RuntimeError(
                    f"tensor-parallel worker rank {rank} did not answer in {timeout:.0f} s"
                )
            try:
                status, value = conn.recv()
            except EOFError:
                raise RuntimeError(f"tensor-parallel worker rank {rank} died") from None
            if status == "error":
                raise RuntimeError(f"tensor-parallel worker failed: {value}")
            results.append(value)
        return results

    def _call(self, method: str, *args):
        self._send(call_message(method, _encoder.encode(args)))
        result = getattr(self.driver, method)(*args)
        return result, self._gather()

    def _send(self, message: bytes) -> None:
        for conn in self.conns:
            conn.send_bytes(message)

    def determine_num_blocks(self) -> int:
        mine, theirs = self._call("determine_num_blocks")
        return min([mine, *theirs])

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call("init_kv_cache", num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._send(step_message(scheduler_output, self._sampled))
        self._sampled = {}  # sent: never twice, even if this step fails
        result = self.driver.execute_model(scheduler_output)
        self._gather()
        self._sampled = {rid: t for rid, t in result.sampled_token_ids.items() if t}
        return result

    def shutdown(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.send_bytes(call_message("stop", _encoder.encode(())))
        deadline = time.monotonic() + _JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.procs, self.conns = [], []
        with contextlib.suppress(Exception):
            from engine.distributed import destroy_distributed

            destroy_distributed()
