"""A tensor-parallel worker that dies while the server runs: /health answers 503, requests
get 503 (or an in-band error event mid-stream), and `tessera serve` stops with exit code 1
so a supervisor restarts it, leaving no worker behind."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import psutil
import pytest
import torch
from litestar.testing import TestClient

from api.server.app import create_app
from api.server.errors import APIError
from api.server.lifespan import ServerState
from api.server.settings import Settings
from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from tests.api.conftest import stream_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny"
BOUND_S = 30.0
DIED = "tensor-parallel worker rank 1"


def _workers(pid: int) -> list[psutil.Process]:
    """The tensor-parallel workers under pid, by the name each gives itself as it starts
    (engine/orphans.name_process: tessera-tpN): not its resource tracker, not the request
    pool's processes (tessera-pool), however far along their own start-up those are."""
    out = []
    for child in psutil.Process(pid).children():
        try:
            if child.name().startswith("tessera-tp"):
                out.append(child)
        except psutil.Error:
            continue
    return out


def test_health_and_requests_answer_503_once_a_worker_died(tiny_llama_dir, tmp_path):
    torch.set_num_threads(1)
    settings = Settings(
        model=str(tiny_llama_dir),
        served_model_name=MODEL,
        auth="none",
        data_dir=str(tmp_path),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        num_kv_blocks=64,
        tensor_parallel_size=2,
        collective_timeout=BOUND_S / 2,
    )
    with TestClient(create_app(settings)) as client:
        deadline = time.monotonic() + 180
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline, client.get("/health").json()
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        (worker,) = _workers(os.getpid())
        worker.kill()  # while the engine is idle: the watcher notices, no step needed
        t0 = time.monotonic()
        while (health := client.get("/health")).status_code == 200:
            assert time.monotonic() - t0 < BOUND_S, "the dead worker went unnoticed"
            time.sleep(0.05)
        assert health.status_code == 503 and health.headers["Retry-After"]
        assert health.json()["status"] == "engine_dead" and DIED in health.json()["error"]
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
        assert "The engine died" in r.json()["error"]["message"]
        assert not worker.is_running()


async def test_a_death_is_reported_before_its_listener_ran(tiny_llama_dir, tmp_path):
    """The engine thread marks itself dead, and tells the server a loop turn later: /health
    and admission must say "died" (not "unhealthy", not admit) in between."""
    engine = await AsyncEngine.create(
        EngineConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_model_len=256),
        )
    )
    state = ServerState(Settings(model=str(tiny_llama_dir), data_dir=str(tmp_path)), engine)
    fatal: list[bool] = []
    state.on_fatal = lambda: fatal.append(True)
    await state.start()
    try:
        engine._mark_dead(EngineDeadError(DIED + " died"))  # as the engine thread does
        assert state.health() == (False, "engine_dead")
        with pytest.raises(APIError) as refused:
            state.require_engine()
        assert refused.value.status_code == 503 and DIED in refused.value.message
        await asyncio.sleep(0.05)  # the listener's turn: told once, not twice
        assert fatal == [True]
    finally:
        await engine.shutdown()


def test_serve_exits_non_zero_when_a_worker_dies_mid_stream(start_server, tiny_llama_dir):
    server = start_server(
        tiny_llama_dir,
        "--served-model-name",
        MODEL,
        "--auth",
        "none",
        "--tensor-parallel-size",
        "2",
        "--collective-timeout",
        str(BOUND_S / 2),
    )
    (worker,) = _workers(server.proc.pid)
    events: list[str] = []
    started = threading.Event()
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 450,
        "stream": True,
        "ignore_eos": True,
    }
    reader = stream_in_thread(server, body, events, started)
    assert started.wait(60)
    worker.kill()
    t0 = time.monotonic()
    code = server.proc.wait(timeout=BOUND_S + 30)
    assert code == 1, server.log()
    assert time.monotonic() - t0 < BOUND_S + 30
    reader.join(30)
    assert not reader.is_alive()
    # The stream in flight ended with an in-band error (then [DONE]), not a hang.
    errors = [json.loads(e)["error"] for e in events if e != "[DONE]" and '"error"' in e]
    assert errors and errors[0]["type"] == "service_unavailable", events[-3:]
    assert DIED in errors[0]["message"]
    assert "The engine died" in server.log() or "tensor-parallel group is dead" in server.log()
    # Nothing left: the worker was reaped (not a zombie under a live parent).
    _, alive = psutil.wait_procs([worker], timeout=10)
    assert not alive
