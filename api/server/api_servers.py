"""Several API server processes in front of one engine core (`--api-server-count N`, vLLM's
API-server scale-out).

One event loop streams every token of every request through the ASGI stack; at hundreds of
streams on a fast GPU that Python, not the GPU, sets the pace (BENCHMARKS.md, `tessera bench
frontend`). With N servers the HTTP work (parsing, auth, quotas, formatting, every SSE chunk)
spreads over N processes, each with its own event loop and GIL, in front of one engine core
process (engine/core_process.py) that schedules and steps for all of them.

    servers = ApiServers(settings, sock, salt, run_server)   # `tessera serve`: N - 1 others
    state.core_peers = servers.core_ends     # the parent's engine hands them to the core
    ... the parent serves on `sock` too ...
    await servers.stopped(timeout)           # they drained; then the parent stops the core

The parent (`tessera serve`) binds the listening socket, spawns the other servers (each builds
the same app from the same settings and accepts on the same socket: the kernel gives each new
connection to one of them) and serves itself as server 0; its engine starts the core with a
channel (two pipes) for each server, and the others attach to the core through theirs. What
the servers share lives in the database (keys, quotas, budgets, the usage ledger, LoRA
adapters loaded at run time: api/lora/registry.py reads the table every 2 s) or is handed
down (the prefix-cache salt secret, so a tenant's prefix hits do not depend on the server its
requests reach); /metrics sums every server's series (prometheus_client's multiprocess mode),
so a scrape may reach any of them.

Life: the others die with the parent and ignore SIGINT (a Ctrl-C reaches the whole process
group); the parent forwards each SIGINT / SIGTERM as SIGTERM (the first drains, the second
aborts, as for the parent), waits for them to exit before it stops the core, and stops with a
non-zero exit if one of them dies while serving, as for a dead engine: a supervisor restarts
the whole server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.core_process import core_channel

if TYPE_CHECKING:
    from api.server.settings import Settings

logger = logging.getLogger("tessera.api")

# The exit code of a server whose engine (the shared core) failed to load or died: the parent's
# own engine says the same, so the parent does not count it as that server's failure.
ENGINE_FAILED_EXIT = 3


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket every API server accepts on (IPv6 where the host is one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    sock.set_inheritable(True)
    return sock


class ApiServers:
    """The API server processes other than the parent's: started at construction, each with
    its channel to the core (the core's ends in `core_ends`, for the parent's engine). `run`:
    what serves in each (api.cli.main.run_server: picklable, called with the process's
    server name, socket, channel and the parent's salt; returns the exit code)."""

    def __init__(
        self, settings: Settings, sock: socket.socket, salt: bytes, run: Callable[..., int]
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.core_ends: list[tuple] = []
        self.procs: list[multiprocessing.Process] = []
        self.failed: str | None = None  # why the whole server must stop (one of them died)
        self._stopping = False
        self._forwarded = 0
        self._on_death: Callable[[], None] | None = None
        for index in range(1, settings.api_server_count):
            core_ends, client_ends = core_channel()
            proc = ctx.Process(
                target=_server_main,
                args=(run, settings, index, sock, client_ends, salt, os.getpid()),
                name=f"tessera-api-{index}",
            )
            proc.start()
            for end in client_ends:  # the child has its copies
                end.close()
            self.core_ends.append(core_ends)
            self.procs.append(proc)
        self._alive = set(self.procs)  # the watcher's to change: it alone reaps them
        self._watcher = threading.Thread(
            target=self._watch, name="tessera-api-servers", daemon=True
        )
        self._watcher.start()

    def on_death(self, callback: Callable[[], None]) -> None:
        """`callback` (from any thread) when a server dies while the parent still serves."""
        self._on_death = callback

    def _watch(self) -> None:
        from multiprocessing.connection import wait

        waiting = {proc.sentinel: proc for proc in self.procs}
        while waiting:
            for sentinel in wait(list(waiting)):
                proc = waiting.pop(sentinel)
                proc.join()
                self._alive.discard(proc)
                # Stopping: a clean exit, or our SIGTERM before its handler was there (a
                # server still starting), is no failure; nor the core's, which is ours too.
                if self._stopping and proc.exitcode in (0, -signal.SIGTERM):
                    continue
                if proc.exitcode == ENGINE_FAILED_EXIT:
                    continue
                if self.failed is None:
                    self.failed = f"API server {proc.name} exited (exit code {proc.exitcode})"
                    logger.error("%s: stopping the server", self.failed)
                    if self._on_death is not None:
                        self._on_death()

    def forward(self, sig: int) -> None:
        """A signal the parent got: SIGTERM to each server (the first drains, the second aborts)."""
        self._stopping = True
        self._forwarded += 1
        for proc in list(self._alive):
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGTERM)

    async def stopped(self, timeout: float) -> None:
        """The servers gone: told to drain if no signal was forwarded yet (the parent stops for
        another reason), waited for up to `timeout` s (plus their abort's flush), then killed."""
        if self._forwarded == 0:
            self.forward(signal.SIGTERM)
        await asyncio.to_thread(self.join, timeout + 10.0)

    def join(self, timeout: float = 10.0) -> None:
        """Every server gone within `timeout` s, or killed: none is left behind. The core's
        ends close here too (if no core took them, a server still loading sees them end)."""
        self._stopping = True
        for end in (end for ends in self.core_ends for end in ends):
            end.close()
        self._watcher.join(timeout)
        for proc in list(self._alive):
            logger.warning("API server %s did not stop: killing it", proc.name)
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
        self._watcher.join(10)


def _server_main(
    run: Callable[..., int],
    settings: Settings,
    index: int,
    sock: socket.socket,
    channel: tuple,
    salt: bytes,
    parent: int,
) -> None:
    """An API server other than the parent: the same app on the same socket, its engine a
    client of the parent's core."""
    from engine.orphans import die_with_parent, name_process

    die_with_parent(parent)
    name_process(f"tessera-api-{index}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent forwards it as SIGTERM
    raise SystemExit(
        run(settings, server_name=f"api-{index}", sock=sock, channel=channel, salt=salt)
    )


class MetricsDir:
    """The directory prometheus_client's multiprocess mode keeps every server's series in;
    removed at exit."""

    def __init__(self) -> None:
        from api.server.metrics import enable_multiprocess_metrics

        self.path = tempfile.mkdtemp(prefix="tessera-metrics-")
        enable_multiprocess_metrics(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


__all__ = ["ENGINE_FAILED_EXIT", "ApiServers", "MetricsDir", "bind_socket"]
