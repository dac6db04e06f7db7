"""The `tessera` command: serve, bench, keys, db, --version.

    tessera serve [MODEL] [--host H] [--port P] [--api-key KEY] ...   (see --help)
    tessera bench serve --base-url http://127.0.0.1:8000 --num-prompts 100
    tessera keys ... / tessera db ...   (api/cli/db.py)
    tessera tenants ...                 (api/cli/tenants.py)

Shutdown: the first SIGTERM or SIGINT starts a drain (new requests get 503, in-flight ones
may finish for --shutdown-timeout seconds, the rest are aborted), then the server stops the
engine and exits 0. A second signal aborts what is left at once. An engine that dies while
serving (a tensor-parallel worker died) stops the server with exit code 1, for a supervisor
to restart it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Generator, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

import engine

if TYPE_CHECKING:
    from api.server.api_servers import ApiServers
    from api.server.lifespan import ServerState
    from api.server.settings import Settings

logger = logging.getLogger("tessera.api")

BENCHMARKS = (
    "serve",
    "throughput",
    "latency",
    "scheduler",
    "auth",
    "decode",
    "attention",
    "compare",
    "affinity",
    "structured",
    "fairness",
    "stop",
    "gguf_memory",
    "gguf_kl",
    "hostile",
    "quant",
    "moe",
    "spec",
    "lora",
    "window",
    "pp",
    "frontend",
)


def build_parser() -> argparse.ArgumentParser:
    from api.server.settings import add_serve_arguments

    parser = argparse.ArgumentParser(prog="tessera", description="Tessera LLM serving engine.")
    parser.add_argument("--version", action="version", version=f"tessera {engine.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="Run the OpenAI-compatible server.",
        description="Run the OpenAI-compatible server. Every flag can also be set as a "
        "TESSERA_* environment variable (e.g. TESSERA_MAX_MODEL_LEN=4096).",
    )
    add_serve_arguments(serve)

    bench = sub.add_parser(
        "bench",
        help="Run a benchmark: " + ", ".join(BENCHMARKS),
        description="Run benchmarks/bench_<NAME>.py; the rest of the arguments go to it.",
        add_help=False,
    )
    bench.add_argument("name", nargs="?", help=f"one of {', '.join(BENCHMARKS)}")
    bench.add_argument("args", nargs=argparse.REMAINDER)

    try:  # keys/db subcommands live with the data layer; the CLI works without them
        from api.cli.db import add_db_parser, add_keys_parser
        from api.cli.tenants import add_tenants_parser
    except ImportError:
        pass
    else:
        add_keys_parser(sub)
        add_tenants_parser(sub)
        add_db_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.command == "serve":
        return _serve(parser, args)
    if args.command == "bench":
        return _bench(parser, args)
    if getattr(args, "func", None) is not None:  # subcommands that bring their own handler
        result = args.func(args)
        return int(result or 0)
    parser.print_help()
    return 2


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.name not in BENCHMARKS:
        parser.error(f"bench: choose one of {', '.join(BENCHMARKS)} (e.g. `tessera bench serve`)")
    try:
        module = importlib.import_module(f"benchmarks.bench_{args.name}")
    except ModuleNotFoundError as e:
        if e.name != f"benchmarks.bench_{args.name}":
            raise
        print(f"tessera bench: benchmarks/bench_{args.name}.py is not installed", file=sys.stderr)
        return 2
    result = module.main(list(args.args))
    return result if isinstance(result, int) else 0


def _serve(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from api.server.settings import Settings

    try:
        settings = Settings.from_args(args)
        settings.create_engine_config()  # fail on bad engine settings before anything starts
    except ValueError as e:
        parser.error(str(e))
    return serve(settings)


def serve(settings: Settings) -> int:
    """Run the server until a signal drains and stops it. 0 on a clean stop, 1 if the
    database is not usable, the app failed to start, the engine failed to load or died (or,
    with --api-server-count, an API server process died)."""
    from api.server.logs import configure_logging

    configure_logging(settings.log_level, settings.log_format)
    if not _database_ready(settings):
        return 1
    if settings.api_server_count == 1:
        return run_server(settings)
    import secrets

    from api.server.api_servers import ApiServers, MetricsDir, bind_socket

    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as e:
        print(
            f"tessera serve: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr
        )
        return 1
    metrics_dir = MetricsDir()  # before any metric exists: the children inherit it
    servers = ApiServers(settings, sock, salt := secrets.token_bytes(32), run_server)
    try:
        return run_server(settings, server_name="api-0", sock=sock, salt=salt, servers=servers)
    finally:
        servers.join()
        sock.close()
        metrics_dir.remove()


def run_server(
    settings: Settings,
    *,
    server_name: str | None = None,
    sock: socket.socket | None = None,
    channel: tuple | None = None,
    salt: bytes | None = None,
    servers: ApiServers | None = None,
) -> int:
    """One API server process: the app under uvicorn until it stops; its exit code. With
    --api-server-count: on the shared `sock`, named `server_name` in the logs; the parent's
    with the other `servers`, another's with its `channel` to the parent's engine core and the
    parent's prefix-cache `salt`."""
    from api.server.app import create_app
    from api.server.http_protocol import guarded_protocol
    from api.server.logs import configure_logging
    from api.server.plugins import installed_routers
    from api.server.tracing import TracingUnavailable, tracing_from_settings

    configure_logging(settings.log_level, settings.log_format, server=server_name)
    try:
        tracing = tracing_from_settings(settings)
    except TracingUnavailable as e:
        print(f"tessera serve: {e}", file=sys.stderr)
        return 1
    if settings.num_threads:
        import torch

        torch.set_num_threads(settings.num_threads)

    app = create_app(settings, tracing=tracing, extra_route_handlers=installed_routers())
    state = app.state.server
    if salt is not None:
        state.cache_salt_secret = salt
    state.core_channel = channel
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        loop=_loop_name(),
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go through ours (api/server/logs.py): one format
        timeout_graceful_shutdown=5,  # after our own drain, only idle connections remain
        lifespan="on",
        http=guarded_protocol(),  # header-read deadline, connection cap (api/server/http_protocol.py)
        timeout_keep_alive=settings.timeout_keep_alive,
    )
    config.header_read_timeout = settings.header_read_timeout
    config.max_connections = settings.limit_concurrency or None
    server = DrainingServer(config, state, forwarded_signals=channel is not None)
    state.on_fatal = server.request_exit
    if servers is not None:
        state.core_peers = servers.core_ends
        state.before_engine_stop.append(servers.stopped)
        servers.on_death(server.request_exit)
        server.on_signal = servers.forward
    server.run(sockets=None if sock is None else [sock])
    if channel is not None and (state.load_error or state.engine_error):
        from api.server.api_servers import ENGINE_FAILED_EXIT

        return ENGINE_FAILED_EXIT  # the parent's engine reports it (one core for all)
    failed = state.load_error or state.engine_error or not server.started
    return 1 if failed or (servers is not None and servers.failed) else 0


def _database_ready(settings: Settings) -> bool:
    """Migrate SQLite / check Postgres before anything starts, with a message, not a trace."""
    from api.db.session import SchemaOutOfDate, redact
    from api.server.access import check_database

    try:
        asyncio.run(check_database(settings))
    except SchemaOutOfDate as e:
        print(f"tessera serve: {e}", file=sys.stderr)
        return False
    except Exception as e:  # noqa: BLE001 - unreachable server, bad credentials, bad path
        url = redact(settings.resolved_database_url())
        print(f"tessera serve: cannot use the database {url}: {e}", file=sys.stderr)
        return False
    return True


def _loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first signal drains instead of closing the listener at once.

    uvicorn on its own stops listening, so new clients would get 'connection refused'
    rather than a 503 they can retry elsewhere, and it does not abort engine work."""

    def __init__(
        self, config: uvicorn.Config, state: ServerState, forwarded_signals: bool = False
    ) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signals = 0
        # An API server other than the parent: SIGINT ignored (a Ctrl-C reaches the whole
        # process group), SIGTERM from the parent, which forwards each signal it gets.
        self.forwarded_signals = forwarded_signals
        self.on_signal: Callable[[int], None] | None = None  # the parent's: forward it

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if not self.forwarded_signals:
            with super().capture_signals():
                yield
            return
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs in the main thread between bytecodes: hand over to the event loop. Not
        # recording the signal (as uvicorn does) keeps uvicorn from re-raising it on exit,
        # so a drained shutdown exits 0.
        self._signals += 1
        if self.on_signal is not None:
            self.on_signal(sig)
        if self._loop is None:
            self.should_exit = True
            return
        self._loop.call_soon_threadsafe(self._on_signal, sig, self._signals == 1)

    def _on_signal(self, sig: int, first: bool) -> None:
        name = signal.Signals(sig).name
        if first:
            logger.info(
                "%s: draining (up to %.0f s), then stopping",
                name,
                self.state.settings.shutdown_timeout,
            )
            asyncio.ensure_future(self._drain_then_exit())
        else:
            logger.warning("%s again: aborting the requests in flight", name)
            asyncio.ensure_future(self._abort_then_exit())

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.drain(self.state.settings.shutdown_timeout)
        finally:
            self.should_exit = True

    async def _abort_then_exit(self) -> None:
        try:
            await self.state.abort_all()
        finally:
            self.should_exit = True

    def request_exit(self) -> None:
        self.should_exit = True


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
