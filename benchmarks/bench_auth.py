"""What auth + quotas cost a request (`tessera bench auth`).

    tessera bench auth [--requests 2000] [--rate 200] [--backends sqlite,postgres]
                       [--http --model M]

Part 1, the hot path in-process: exactly the calls a generation request makes before and
after its engine work — Authenticator.authenticate (cached key lookup), Accountant.admit
(QuotaService.acquire), Accountant.settle + released (usage row queued, reservation
reconciled, parallel slot freed) — for a key with rpm, tpm, parallel and budget limits, on a
fresh SQLite file and a fresh Postgres database, against `--auth none` (no-op leases).
Requests arrive open-loop at --rate per second (the issue's "at 200 requests/s"); printed:
latency added before the engine sees the request (admit), after it finished (release), their
sum per request, and the process CPU per request.

Part 2 (--http): real `tessera serve` processes on loopback, `--auth none` vs keys mode on
SQLite and Postgres: GET /v1/models (auth only) at fixed concurrency, and
POST /v1/completions with max_tokens=1 (auth + quota + engine) open-loop at --http-rate,
with a limited key. Per-request overhead = mean latency minus --auth none's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

PG_ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/test"
LIMITS = dict(rpm_limit=10**9, tpm_limit=10**15, max_parallel=10**6, token_budget=10**15)


@dataclass(slots=True)
class Result:
    name: str
    admit_ms: list[float]
    release_ms: list[float]
    cpu_ms: float
    achieved_rate: float

    def line(self) -> str:
        total = [a + r for a, r in zip(self.admit_ms, self.release_ms, strict=True)]
        return (
            f"{self.name:<10} {self.achieved_rate:7.0f}/s  admit {_stats(self.admit_ms)}  "
            f"release {_stats(self.release_ms)}  total {_stats(total)}  "
            f"cpu {self.cpu_ms:.2f} ms/req"
        )


def _stats(ms: list[float]) -> str:
    p50 = statistics.median(ms)
    p99 = statistics.quantiles(ms, n=100)[98] if len(ms) >= 100 else max(ms)
    return f"mean {statistics.fmean(ms):5.2f} p50 {p50:5.2f} p99 {p99:6.2f} ms"


# -- databases -----------------------------------------------------------------------------


async def _pg(dsn: str, statement: str) -> None:
    import asyncpg

    conn = await asyncpg.connect(dsn, timeout=5)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


@contextlib.contextmanager
def database(backend: str, tmp: Path, pg_dsn: str) -> Iterator[str | None]:
    """None (--auth none), a fresh SQLite file, or a fresh Postgres database (dropped after)."""
    if backend == "none":
        yield None
        return
    if backend == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp / f'bench-{uuid.uuid4().hex[:8]}.db'}"
        return
    name = f"tessera_bench_{uuid.uuid4().hex[:12]}"  # generated here, never input
    asyncio.run(_pg(pg_dsn, f'CREATE DATABASE "{name}"'))
    base = pg_dsn.rsplit("/", 1)[0].replace("postgresql://", "postgresql+asyncpg://")
    try:
        yield f"{base}/{name}"
    finally:
        asyncio.run(_pg(pg_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


# -- part 1: the hot path in-process -------------------------------------------------------


async def paced(n: int, rate: float, one: Callable[[int], Awaitable[None]]) -> float:
    """Start one(i) at rate/s (open loop) for i < n; the achieved rate."""
    t0 = time.perf_counter()
    tasks = []
    for i in range(n):
        delay = t0 + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return n / (time.perf_counter() - t0)


async def hot_path(backend: str, url: str | None, requests: int, rate: float) -> Result:
    from api.db.session import Database
    from api.keys.auth import Authenticator
    from api.keys.service import KeyService
    from api.quotas.service import QuotaService
    from api.usage.accounting import Accountant
    from api.usage.service import UsageRecorder
    from engine.outputs import CompletionOutput, RequestOutput

    db = Database.from_url(url) if url else None
    if db is not None:
        await db.upgrade()
        _, key = await KeyService(db).create("bench", **LIMITS)
        auth = Authenticator(db, mode="keys", static_keys=[], admin_token=None)
        recorder = UsageRecorder(db)
        await recorder.start()
        accountant = Accountant(QuotaService(db), recorder)
    else:
        key = "unused"
        auth = Authenticator(None, mode="none", static_keys=[], admin_token=None)
        recorder = None
        accountant = Accountant(None, None)
    header = f"Bearer {key}"
    prompt = list(range(20))
    out = RequestOutput(
        "x", None, prompt, [CompletionOutput(0, "", list(range(10)), "length")], True
    )
    admit_ms = [0.0] * requests
    release_ms = [0.0] * requests

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        principal = await auth.authenticate(header)
        ticket = await accountant.admit(principal, f"r{i}", "m", len(prompt) + 16)
        t1 = time.perf_counter()
        accountant.settle(ticket, [out], [prompt])
        await accountant.released(ticket)
        admit_ms[i] = (t1 - t0) * 1000
        release_ms[i] = (time.perf_counter() - t1) * 1000

    try:
        await paced(min(50, requests), rate, one)  # warm up: pools, caches, statements
        cpu0 = time.process_time()
        achieved = await paced(requests, rate, one)
        cpu = (time.process_time() - cpu0) * 1000 / requests
    finally:
        await accountant.aclose()
        if recorder is not None:
            await recorder.stop()
        if db is not None:
            await db.dispose()
    return Result(backend, admit_ms, release_ms, cpu, achieved)


# -- part 2: over HTTP ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(args: list[str], log: Path):
    import httpx

    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    cmd = [sys.executable, "-m", "api.cli", "serve", *args, "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited:\n{log.read_text()[-3000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not healthy: see {log}")
                time.sleep(0.2)
            yield base
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


@dataclass(slots=True)
class HttpTarget:
    name: str
    base: str
    key: str | None
    models_s: float = 0.0  # wall time of the GET /v1/models rounds
    models_n: int = 0
    models_ms: list[float] = field(default_factory=list)
    complete_ms: list[float] = field(default_factory=list)


async def http_round(t: HttpTarget, model: str, n: int, concurrency: int, rate: float) -> None:
    """n GET /v1/models at fixed concurrency, then n/4 POST /v1/completions at `rate`."""
    import httpx

    headers = {"Authorization": f"Bearer {t.key}"} if t.key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=t.base, headers=headers, limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)

        async def get_models(_: int) -> None:
            async with sem:
                start = time.perf_counter()
                (await c.get("/v1/models")).raise_for_status()
                t.models_ms.append((time.perf_counter() - start) * 1000)

        t0 = time.perf_counter()
        await asyncio.gather(*(get_models(i) for i in range(n)))
        t.models_s += time.perf_counter() - t0
        t.models_n += n
        body = {"model": model, "prompt": "Hello there", "max_tokens": 1}

        async def complete(_: int) -> None:
            start = time.perf_counter()
            (await c.post("/v1/completions", json=body, timeout=60)).raise_for_status()
            t.complete_ms.append((time.perf_counter() - start) * 1000)

        await paced(max(5, n // 4), rate, complete)


async def _create_key(url: str) -> str:
    from api.db.session import Database
    from api.keys.service import KeyService

    db = Database.from_url(url)
    try:
        return (await KeyService(db).create("bench", **LIMITS))[1]
    finally:
        await db.dispose()


def run_http(args: argparse.Namespace, tmp: Path, backends: list[str]) -> None:
    """All servers up at once; rounds interleaved across them, so that a machine whose
    load drifts (other processes) biases no configuration."""
    common = [args.model, "--served-model-name", "bench", "--max-model-len", "256"]
    common += ["--log-level", "warning", *args.server_arg]
    with contextlib.ExitStack() as stack:
        targets = []
        for backend in ["none", *backends]:
            url = stack.enter_context(database(backend, tmp, args.postgres_dsn))
            extra = ["--auth", "none"] if url is None else ["--database-url", url]
            extra += ["--data-dir", str(tmp / backend), "--admin-token", "tsa-bench"]
            if url is not None and not url.startswith("sqlite"):
                from api.cli.main import main as cli

                cli(["db", "upgrade", "--database-url", url])
            base = stack.enter_context(server(common + extra, tmp / f"{backend}.log"))
            key = asyncio.run(_create_key(url)) if url else None
            targets.append(HttpTarget(backend, base, key))
        rounds = 10
        per_round = max(20, args.requests // rounds)
        for t in targets:  # warm-up: connections, caches, prepared statements
            asyncio.run(http_round(t, "bench", 40, args.concurrency, args.http_rate))
            t.models_ms.clear(), t.complete_ms.clear()
            t.models_s, t.models_n = 0.0, 0
        for _ in range(rounds):
            for t in targets:
                asyncio.run(http_round(t, "bench", per_round, args.concurrency, args.http_rate))
    base_models = statistics.fmean(targets[0].models_ms)
    base_complete = statistics.fmean(targets[0].complete_ms)
    print(
        f"\nHTTP, {rounds} interleaved rounds: GET /v1/models x{per_round} at concurrency "
        f"{args.concurrency}, POST /v1/completions (max_tokens=1, a limited key) "
        f"x{max(5, per_round // 4)} at {args.http_rate:.0f}/s"
    )
    for t in targets:
        models, complete = statistics.fmean(t.models_ms), statistics.fmean(t.complete_ms)
        print(
            f"{t.name:<10} /v1/models {t.models_n / t.models_s:6.0f}/s, mean {models:5.2f} ms "
            f"({models - base_models:+5.2f})   /v1/completions mean {complete:5.2f} ms "
            f"({complete - base_complete:+5.2f})"
        )


# -- entry point ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tessera bench auth", description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--rate", type=float, default=200.0, help="requests/s of the hot-path run")
    p.add_argument("--backends", default="sqlite,postgres", help="comma-separated")
    p.add_argument(
        "--postgres-dsn", default=PG_ADMIN_DSN, help="a database to CREATE DATABASE from"
    )
    p.add_argument("--http", action="store_true", help="also measure real servers over HTTP")
    p.add_argument("--model", default="smollm2-135m-instruct", help="model for --http")
    p.add_argument("--server-arg", action="append", default=[], help="extra `tessera serve` flag")
    p.add_argument("--concurrency", type=int, default=8, help="GET /v1/models concurrency")
    p.add_argument("--http-rate", type=float, default=50.0, help="completions/s for --http")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgres"}
    if unknown:
        p.error(f"unknown backend(s): {', '.join(sorted(unknown))}")

    with tempfile.TemporaryDirectory(prefix="tessera-bench-auth-") as tmpdir:
        tmp = Path(tmpdir)
        print(f"Hot path in-process: {args.requests} requests at {args.rate:.0f}/s (open loop)")
        base: Result | None = None
        for backend in ["none", *backends]:
            with database(backend, tmp, args.postgres_dsn) as url:
                result = asyncio.run(hot_path(backend, url, args.requests, args.rate))
            print(result.line(), flush=True)
            if base is None:
                base = result
            else:
                added = statistics.fmean(
                    a + r for a, r in zip(result.admit_ms, result.release_ms, strict=True)
                ) - statistics.fmean(
                    a + r for a, r in zip(base.admit_ms, base.release_ms, strict=True)
                )
                print(f"{'':<10} auth + quota add {added:.2f} ms per request (latency), "
                      f"{result.cpu_ms - base.cpu_ms:.2f} ms CPU")  # fmt: skip
        if args.http:
            run_http(args, tmp, backends)
    return 0


if __name__ == "__main__":
    sys.exit(main())
