"""A tensor-parallel worker that dies marks the engine dead: the real WorkerGroup at TP=2 on
gloo, its worker killed with SIGKILL between steps and in the middle of a long generate. The
call raises EngineDeadError (it does not hang) within a bounded time, later calls fail at
once, and no worker process is left behind. A worker that hangs (SIGSTOP) is ended by the
collective timeout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import torch

from engine import LLM, EngineArgs, SamplingParams
from engine.async_engine import AsyncEngine
from engine.errors import EngineDeadError
from engine.protocol import EngineRequest

pytestmark = pytest.mark.slow

BOUND_S = 30.0  # how long noticing a dead worker may take, at most
OPTIONS = dict(
    dtype="float32",
    num_kv_blocks=64,
    block_size=8,
    max_model_len=256,
    tensor_parallel_size=2,
    device="cpu",
    collective_timeout=BOUND_S / 2,  # the backstop; a dead peer is seen long before
)
DIED = r"tensor-parallel worker rank 1 \(pid \d+\) died \(killed by SIGKILL\)"


def _live_workers(pids: list[int]) -> list[int]:
    """Those of pids still running (a zombie counts: nobody reaped it)."""
    alive = []
    for pid in pids:
        try:
            psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            continue
        alive.append(pid)
    return alive


def _spawned_children() -> list[int]:
    """This process's multiprocessing children other than its resource tracker."""
    out = []
    for child in psutil.Process().children():
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmd:
            out.append(child.pid)
    return out


def test_worker_killed_between_steps(tiny_llama_dir):
    torch.set_num_threads(1)
    before = set(_spawned_children())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), **OPTIONS)
    try:
        pids = [p.pid for p in llm.engine.executor.workers.procs]
        assert len(pids) == 1 and set(_spawned_children()) - before == set(pids)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=DIED):
            llm.generate([[8, 9, 10]], params)
        assert time.monotonic() - t0 < BOUND_S
        assert _live_workers(pids) == []  # reaped, not a zombie
        # Dead for good: later requests fail at once, with the same reason.
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=DIED):
            llm.generate([[11, 12]], params)
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(EngineDeadError):
            llm.engine.check_alive()
    finally:
        llm.shutdown()
    assert set(_spawned_children()) - before == set()


async def test_worker_killed_during_a_long_generate(tiny_llama_dir):
    """Through AsyncEngine: the stream in flight fails with EngineDeadError, the engine is
    unhealthy, new requests are refused at once and the on_dead listeners hear of it."""
    torch.set_num_threads(1)
    before = set(_spawned_children())
    config = EngineArgs(model=str(tiny_llama_dir), **OPTIONS).create_engine_config()
    engine = await AsyncEngine.create(config)
    deaths: list[EngineDeadError] = []
    engine.on_dead(deaths.append)
    try:
        pids = [p.pid for p in engine.engine.executor.workers.procs]
        params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        seen = 0
        t0 = None
        with pytest.raises(EngineDeadError, match=DIED):
            async for out in engine.generate(EngineRequest("long", list(range(10, 20)), params)):
                seen = len(out.outputs[0].token_ids)
                if t0 is None and seen >= 3:  # mid-run: the steps go on around the kill
                    os.kill(pids[0], signal.SIGKILL)
                    t0 = time.monotonic()
        assert t0 is not None and time.monotonic() - t0 < BOUND_S
        assert seen < 240
        assert not engine.is_healthy()
        for _ in range(100):  # the listeners run on the event loop, after the stream's error
            if deaths:
                break
            await asyncio.sleep(0.01)
        assert len(deaths) == 1 and isinstance(deaths[0], EngineDeadError)
        t1 = time.monotonic()
        with pytest.raises(EngineDeadError, match=DIED):
            async for _ in engine.generate(EngineRequest("after", [1, 2, 3], params)):
                pass
        assert time.monotonic() - t1 < 1.0
        assert _live_workers(pids) == []
    finally:
        await engine.shutdown()
    assert set(_spawned_children()) - before == set()


def test_a_stuck_worker_times_out_the_collective(tiny_llama_dir):
    """A worker that stops answering (SIGSTOP: alive, its sockets open) cannot hold the
    driver in an all-reduce: the collective timeout ends the step, the group is dead."""
    torch.set_num_threads(1)
    before = set(_spawned_children())
    timeout_s = 3.0  # short: the rendezvous waits for the workers' imports separately
    llm = LLM(str(tiny_llama_dir), **{**OPTIONS, "collective_timeout": timeout_s})
    try:
        pids = [p.pid for p in llm.engine.executor.workers.procs]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
        os.kill(pids[0], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="a tensor-parallel step failed"):
            llm.generate([[8, 9, 10]], params)
        assert timeout_s <= time.monotonic() - t0 < timeout_s + 10
        assert _live_workers(pids) == []  # the stuck worker was killed and reaped
    finally:
        llm.shutdown()
    assert set(_spawned_children()) - before == set()


@pytest.mark.parametrize("when", ["between steps", "mid-generate"])
def test_a_pipeline_stage_killed(tiny_llama_dir, when):
    """PP=2: the last stage (rank 1, the one that samples) killed between steps or while
    the driver's stage sends it hidden states: the engine is dead within the bound."""
    torch.set_num_threads(1)
    before = set(_spawned_children())
    options = {**OPTIONS, "tensor_parallel_size": 1, "pipeline_parallel_size": 2}
    llm = LLM(str(tiny_llama_dir), **options)
    try:
        pids = [p.pid for p in llm.engine.executor.workers.procs]
        assert len(pids) == 1
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], short)[0].outputs[0].token_ids) == 4
        if when == "between steps":
            os.kill(pids[0], signal.SIGKILL)
            params = short
        else:  # killed as the 5th step of the generate starts: the stages mid-exchange
            executor = llm.engine.executor  # (under PP the engine submits, then collects)
            submit, steps = executor.submit, []

            def killing_submit(so):
                steps.append(so)
                if len(steps) == 5:
                    os.kill(pids[0], signal.SIGKILL)
                return submit(so)

            executor.submit = killing_submit
            params = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=DIED):
            llm.generate([list(range(10, 20))] * 4, params)
        assert time.monotonic() - t0 < BOUND_S + 1.0
        assert _live_workers(pids) == []
        with pytest.raises(EngineDeadError, match=DIED):
            llm.generate([[11, 12]], short)
    finally:
        llm.shutdown()
    assert set(_spawned_children()) - before == set()
