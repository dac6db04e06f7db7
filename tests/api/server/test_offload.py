"""The worker processes for CPU-heavy request steps (api/server/offload.py): the same answers as
inline, errors that arrive whole, a lower CPU priority, and a pool that survives a killed
worker."""

from __future__ import annotations

import asyncio
import functools
import os
import signal

import msgspec
import pytest

from api.openai.inputs import encode_text, render_chat
from api.openai.schemas import ChatMessage
from api.openai.tools.plan import ToolPlan, template_input
from api.server.errors import APIError
from api.server.offload import WORKER_NICENESS, WorkerPool
from engine.tokenizer import Tokenizer


def _pid(tokenizer) -> tuple[int, int, int]:
    """(pid, nice value, vocabulary size) of the process that runs a step."""
    return os.getpid(), os.getpriority(os.PRIO_PROCESS, 0), tokenizer.vocab_size


def _messages(n: int) -> list[ChatMessage]:
    raw = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"word {i}"} for i in range(n)
    ]
    return msgspec.convert(raw, list[ChatMessage])


@pytest.fixture
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture
def pool(tokenizer):
    pool = WorkerPool(workers=1, inline_cost=10)
    pool.start(tokenizer)
    yield pool
    pool.shutdown()


def test_a_step_runs_in_a_nicer_process_with_the_same_tokenizer(pool, tokenizer):
    pid, nice, vocab = asyncio.run(pool.tokenizer_call(100, _pid))
    assert pid != os.getpid()
    assert nice == os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS or nice == 19
    assert vocab == tokenizer.vocab_size
    # Small steps stay inline, on the tokenizer itself.
    assert asyncio.run(pool.tokenizer_call(1, _pid))[0] == os.getpid()


def test_template_and_tokenizer_in_a_worker_equal_inline(pool, tokenizer):
    messages = _messages(40)
    plan = ToolPlan(
        choice="auto",
        parser="generic",
        tools=[{"type": "function", "function": {"name": "f", "description": "does f"}}],
        functions={"f": {"name": "f", "description": "does f"}},
    )
    prepare = functools.partial(template_input, plan=plan, parser="generic")
    args = (messages, True, "messages", {"documents": [{"text": "doc"}]}, prepare)
    inline = render_chat(tokenizer, *args)
    assert asyncio.run(pool.tokenizer_call(10**6, render_chat, *args)) == inline
    text = "The capital of France is Paris. " * 50
    assert asyncio.run(pool.tokenizer_call(10**6, encode_text, text, True)) == tokenizer.encode(
        text
    )
    assert pool.steps["render_chat"][0] == 1 and pool.steps["encode_text"][0] == 1


def test_an_error_in_a_worker_arrives_as_the_same_400(pool):
    bad = msgspec.convert([{"role": "robot", "content": "x"}], list[ChatMessage])
    with pytest.raises(APIError) as caught:
        asyncio.run(pool.tokenizer_call(10**6, render_chat, bad, True, None, None, None))
    assert caught.value.status_code == 400
    assert caught.value.param == "messages[0].role"
    assert "robot" in caught.value.message


def test_a_killed_worker_is_replaced_and_the_step_runs_again(pool):
    first, _, _ = asyncio.run(pool.tokenizer_call(100, _pid))
    os.kill(first, signal.SIGKILL)
    second, _, _ = asyncio.run(pool.tokenizer_call(100, _pid))
    assert second not in (first, os.getpid())


def test_before_start_steps_run_on_a_thread():
    pool = WorkerPool(workers=1, inline_cost=0)
    try:
        assert asyncio.run(pool.run(os.getpid)) == os.getpid()
        with pytest.raises(RuntimeError, match="start"):
            asyncio.run(pool.tokenizer_call(100, _pid))
    finally:
        pool.shutdown()


_ORPHAN_SCRIPT = """
import asyncio, os, sys, time
from api.server.offload import WorkerPool
from engine.tokenizer import Tokenizer
from tests.api.server.test_offload import _pid

pool = WorkerPool(workers=1, inline_cost=0)
pool.start(Tokenizer.from_pretrained(sys.argv[1]))
print(asyncio.run(pool.tokenizer_call(100, _pid))[0], flush=True)
time.sleep(600)
"""


def test_a_worker_dies_with_the_server(tiny_llama_dir):
    """SIGKILL of the server (no shutdown runs) takes its worker processes with it."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    server = subprocess.Popen(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(tiny_llama_dir)],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        worker = int(server.stdout.readline())
        os.kill(worker, 0)  # alive
    finally:
        server.kill()
        server.wait()
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(worker, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, f"worker {worker} outlived its server"
        time.sleep(0.1)
