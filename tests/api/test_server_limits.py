"""Backpressure and graceful shutdown, on a real server with 2 tensor-parallel ranks (so there
is a worker process that must not survive), 2 batch slots and a waiting queue of 2.

The module's tests run in order: the SIGTERM drain test ends the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time

import httpx
import psutil
import pytest

from tests.api.conftest import stream_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--auth",
        "none",
        "--tensor-parallel-size",
        "2",
        "--max-num-seqs",
        "2",
        "--max-num-queued-requests",
        "2",
        "--shutdown-timeout",
        "60",
    )


def test_overload_gets_503_before_any_work(server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 60, "ignore_eos": True}

    async def one(c: httpx.AsyncClient, i: int) -> tuple[httpx.Response, float]:
        r = await c.post("/v1/completions", json={**body, "prompt": f"Hello {i}"})
        return r, time.monotonic()

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(12)))

    results = asyncio.run(burst())
    admitted = [(r, t) for r, t in results if r.status_code == 200]
    refused = [(r, t) for r, t in results if r.status_code == 503]
    assert len(admitted) + len(refused) == 12, [r.status_code for r, _ in results]
    assert refused, "a queue of 2 behind 2 slots must refuse some of 12 requests"
    assert len(admitted) >= 2
    for r, _ in refused:
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "service_unavailable"
    # Refused at once: every 503 came back before the first admitted request finished.
    assert max(t for _, t in refused) < min(t for _, t in admitted)
    for r, _ in admitted:
        assert r.json()["usage"]["completion_tokens"] == 60
    # The server is fine afterwards.
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_disconnect_while_queued_frees_the_queue_place(server):
    """A client that leaves while its request waits for a batch slot is dropped from the
    queue at once (the server watches the connection during admission too)."""

    async def scenario() -> tuple[dict, dict]:
        long_body = {"model": MODEL, "prompt": "Hi", "max_tokens": 450, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:

            async def stats() -> dict:
                body = (await c.get("/health", params={"verbose": "true"})).json()
                return {**body["engine"], "inflight": body["inflight_requests"]}

            async def until(predicate) -> dict:
                deadline = time.monotonic() + 60
                while not predicate(s := await stats()):
                    assert time.monotonic() < deadline, s
                    await asyncio.sleep(0.01)
                return s

            busy = [asyncio.create_task(c.post("/v1/completions", json=long_body)) for _ in "ab"]
            await until(lambda s: s["num_running"] == 2)
            queued = asyncio.create_task(
                c.post("/v1/completions", json={**long_body, "stream": True})
            )
            during = await until(lambda s: s["num_waiting"] == 1)
            queued.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await queued
            after = await until(lambda s: s["num_waiting"] == 0 and s["inflight"] <= 2)
            for task in busy:
                task.cancel()
            await asyncio.gather(*busy, return_exceptions=True)
            return during, after

    during, after = asyncio.run(scenario())
    assert during["num_waiting"] == 1 and during["num_running"] == 2
    # The two long requests still run: the queued one left while they did.
    assert after["num_running"] == 2 and after["inflight"] == 2
    r = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200


def _stream_into(server, events: list[str], started: threading.Event, max_tokens: int):
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
        "stream_options": {"include_usage": True},
    }
    return stream_in_thread(server, body, events, started)


def test_sigterm_drains_then_exits_cleanly(server):
    """First SIGTERM: 503 for new work while a short stream finishes; second SIGTERM: the
    long stream still running is aborted with an in-band error event; exit 0, no worker left."""
    proc = psutil.Process(server.proc.pid)
    workers = proc.children(recursive=True)
    assert workers, "tensor_parallel_size 2 must run a worker process"

    short_events: list[str] = []
    long_events: list[str] = []
    short_started, long_started = threading.Event(), threading.Event()
    long_reader = _stream_into(server, long_events, long_started, 450)
    short_reader = _stream_into(server, short_events, short_started, 40)
    assert short_started.wait(60) and long_started.wait(60)
    server.signal(signal.SIGTERM)

    # Draining: new work is refused with 503 + Retry-After, /health says so.
    deadline = time.monotonic() + 10
    while True:
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            timeout=30,
        )
        if r.status_code == 503 or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # the signal may not have landed yet
    assert r.status_code == 503 and r.headers["Retry-After"]
    assert "shutting down" in r.json()["error"]["message"]
    health = httpx.get(server.base_url + "/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "draining"

    # The short in-flight stream runs to its end.
    short_reader.join(120)
    assert short_events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in short_events[:-1]]
    assert "error" not in chunks[-1]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"

    # The long one is still going; a second signal aborts it, in-band.
    assert server.proc.poll() is None and long_events[-1] != "[DONE]"
    server.signal(signal.SIGTERM)
    long_reader.join(60)
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert error["type"] == "service_unavailable" and "aborted" in error["message"]

    # Then the process exits 0 and no worker outlives it.
    assert server.proc.wait(timeout=60) == 0
    _, alive = psutil.wait_procs(workers, timeout=10)  # they notice their parent is gone
    alive = [w for w in alive if _status(w) not in ("gone", psutil.STATUS_ZOMBIE)]
    assert not alive, [(w.pid, _status(w), w.cmdline()) for w in alive]


def _status(p: psutil.Process) -> str:
    try:
        return p.status()
    except psutil.NoSuchProcess:
        return "gone"
