"""Fixtures for server tests: a real `tessera serve` subprocess on loopback, random free port.

    start_server(model_dir, "--api-key", "k", ...) -> ServerProcess   (stopped at teardown)

The server runs a tiny random model from tests/conftest.py with one torch thread, float32
and an explicit KV block count, so tests are deterministic and small.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_in_thread(
    server, body: dict, events: list[str], started: threading.Event, headers: dict | None = None
) -> threading.Thread:
    """POST a streaming /v1/completions on a thread, appending each SSE data payload to
    `events` and setting `started` at the first one (for tests that act mid-stream)."""

    def run() -> None:
        url = server.base_url + "/v1/completions"
        with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    started.set()

    thread = threading.Thread(target=run)
    thread.start()
    return thread


class ServerProcess:
    def __init__(
        self,
        args: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        serve: list[str] | None = None,
        cwd: Path = REPO,
    ):
        """`serve`: the command that serves, default this interpreter's `-m api.cli serve` from
        the checkout; another one (an installed `tessera serve`) runs without PYTHONPATH, which
        would put the checkout first on its path."""
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        base_env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
        if serve is not None:
            base_env.pop("PYTHONPATH", None)
        base_env.update({"TESSERA_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        base_env.update(env or {})
        cmd = [*(serve or [sys.executable, "-m", "api.cli", "serve"]), *args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=cwd, env=base_env, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not healthy after {timeout} s:\n{self.log()}")

    def stats(self) -> dict:
        body = httpx.get(self.base_url + "/health", params={"verbose": "true"}, timeout=10).json()
        return {**body["engine"], "inflight_requests": body["inflight_requests"]}

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """Poll until no request holds KV blocks or a queue slot; the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            idle = (
                stats["num_running"] == 0
                and stats["num_waiting"] == 0
                and stats["kv_cache_usage"] == 0.0
                and stats["inflight_requests"] == 0
            )
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def log(self, tail: int | None = 5000) -> str:
        """The server's output so far: its last `tail` characters (for error messages), or all
        of it (None: a first start that compiles the CPU kernels logs many 503 health polls
        after its banner)."""
        self._log.flush()
        text = self.log_path.read_text(errors="replace")
        return text if tail is None else text[-tail:]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory) -> Path:
    """The tiny model trained to call tools (tests/api/openai/tools/tool_model.py), built once
    a session: the tool-call, Anthropic and Responses modules all serve it."""
    from tests.api.openai.tools.tool_model import build_tool_model

    return build_tool_model(tmp_path_factory.mktemp("tool-model"))


@pytest.fixture(scope="module")
def start_server(tmp_path_factory) -> Iterator:
    started: list[ServerProcess] = []

    def start(model_dir: Path, *args: str, env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        common = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "2048"]
        server = ServerProcess([str(model_dir), *common, *args], log, env)
        started.append(server)
        server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()
