"""`tessera serve --engine-process`: the engine core in a child process behind a real server on
loopback. The OpenAI SDK's stream and the plain completion give the in-thread server's greedy
text; /health's engine stats and /metrics come across the pipe; SIGTERM drains and stops the
child with the server; a child killed mid-stream ends the stream with an in-band error, turns
/health to engine_dead and stops the server with exit code 1, leaving no process behind."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.api.conftest import stream_in_thread

pytestmark = pytest.mark.slow

MODEL = "tiny"
ARGS = ("--served-model-name", MODEL, "--auth", "none", "--max-num-seqs", "8")


def _core(pid: int) -> psutil.Process:
    """The server's engine core (engine/core_process.py names it tessera-core)."""
    (core,) = [p for p in psutil.Process(pid).children() if p.name() == "tessera-core"]
    return core


def _greedy(server) -> tuple[str, list[str]]:
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")
    body = dict(model=MODEL, prompt="Hello world", max_tokens=12, temperature=0)
    whole = client.completions.create(**body, extra_body={"ignore_eos": True}).choices[0].text
    chunks = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
    return whole, [c.choices[0].text for c in chunks if c.choices]


def test_a_server_with_the_engine_in_a_process(start_server, tiny_llama_dir):
    threaded = start_server(tiny_llama_dir, *ARGS)
    want = _greedy(threaded)
    threaded.stop()
    server = start_server(tiny_llama_dir, *ARGS, "--engine-process")
    core = _core(server.proc.pid)
    whole, chunks = _greedy(server)
    # the same text, whole and streamed (the chunks' borders follow the stream's timing)
    assert whole == want[0] == "".join(chunks) == "".join(want[1]) and len(chunks) > 1
    stats = server.wait_idle()
    assert stats["generation_tokens_total"] == 24 and stats["num_blocks"] > 0
    metrics = httpx.get(server.base_url + "/metrics", timeout=10).text
    assert "vllm:generation_tokens_total" in metrics
    server.signal(signal.SIGTERM)
    assert server.proc.wait(timeout=60) == 0, server.log()
    core.wait(timeout=30)
    assert not core.is_running()


def test_a_killed_engine_process_stops_the_server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *ARGS, "--engine-process")
    core = _core(server.proc.pid)
    events: list[str] = []
    started = threading.Event()
    body = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    reader = stream_in_thread(server, body, events, started)
    assert started.wait(60)
    core.kill()
    t0 = time.monotonic()
    code = server.proc.wait(timeout=60)
    assert code == 1, server.log()
    assert time.monotonic() - t0 < 60
    reader.join(30)
    assert not reader.is_alive()
    assert any("engine process exited" in e for e in events), events[-3:]
    assert "The engine died" in server.log()
