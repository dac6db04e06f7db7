"""AsyncEngine: the step loop on its own thread, per-request streams, abort on cancel."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SamplingParams,
    SchedulerConfig,
    async_engine,
)
from engine.async_engine import AsyncEngine
from engine.errors import QueueFullError
from engine.protocol import EngineClient, EngineRequest, Tenancy


def make_config(model_dir, **kw) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=kw.pop("num_blocks", 64)),
        scheduler=SchedulerConfig(max_num_seqs=kw.pop("max_num_seqs", 32), max_model_len=256),
        **kw,
    )


async def wait_until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


async def collect(engine, request_id, ids, params):
    last = None
    async for out in engine.generate(EngineRequest(request_id, ids, params)):
        last = out
    return last


async def test_streams_cumulative_outputs(tiny_llama_dir):
    engine = await AsyncEngine.create(make_config(tiny_llama_dir))
    try:
        assert isinstance(engine, EngineClient)  # the one surface the server uses
        ids = engine.tokenizer.encode("Hello world")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        seen = []
        async for out in engine.generate(EngineRequest("r1", ids, params)):
            seen.append(list(out.outputs[0].token_ids))
        assert len(seen[-1]) == 6 and out.finished and out.outputs[0].finish_reason == "length"
        for a, b in zip(seen, seen[1:], strict=False):
            assert b[: len(a)] == a  # each output extends the previous one
        # Concurrent requests each get their own, complete stream.
        results = await asyncio.gather(*(collect(engine, f"c{i}", ids, params) for i in range(8)))
        assert all(r.outputs[0].token_ids == seen[-1] for r in results)
        stats = engine.stats()
        assert stats.generation_tokens_total == 6 * 9 and stats.kv_cache_usage == 0.0
        assert engine.is_healthy()
    finally:
        await engine.shutdown()


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tessera-engine"]


async def test_the_engine_loads_and_steps_on_one_thread(tiny_llama_dir, monkeypatch):
    # libgomp keeps a team per thread that opens parallel regions; two teams on two cores
    # throttle both to futex waits. So the thread that loads is the one that steps.
    real_init, real_step = async_engine.LLMEngine.__init__, async_engine.LLMEngine.step
    loaded_on, stepped_on = set(), set()

    def init(self, *args, **kwargs):
        loaded_on.add(threading.get_ident())
        real_init(self, *args, **kwargs)

    def step(self):
        stepped_on.add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(async_engine.LLMEngine, "__init__", init)
    monkeypatch.setattr(async_engine.LLMEngine, "step", step)
    engine = await AsyncEngine.create(make_config(tiny_llama_dir))
    try:
        ids = engine.tokenizer.encode("Hello world")
        out = await collect(engine, "r", ids, SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 4
        assert loaded_on == stepped_on == {engine._thread.ident}
        assert threading.get_ident() not in loaded_on
    finally:
        await engine.shutdown()
    assert not engine._thread.is_alive()


async def test_a_failed_load_raises_and_leaves_no_thread(tmp_path):
    before = engine_threads()
    with pytest.raises(ValueError, match="missing' not found"):
        await AsyncEngine.create(make_config(tmp_path / "missing"))
    await wait_until(lambda: engine_threads() == before)


async def test_a_cancelled_create_shuts_the_loaded_engine_down(tiny_llama_dir, monkeypatch):
    release, shut = threading.Event(), []
    real_init, real_shutdown = async_engine.LLMEngine.__init__, async_engine.LLMEngine.shutdown

    def slow_init(self, *args, **kwargs):
        release.wait(30)
        real_init(self, *args, **kwargs)

    def shutdown(self):
        shut.append(self)
        real_shutdown(self)

    monkeypatch.setattr(async_engine.LLMEngine, "__init__", slow_init)
    monkeypatch.setattr(async_engine.LLMEngine, "shutdown", shutdown)
    before = engine_threads()
    task = asyncio.create_task(AsyncEngine.create(make_config(tiny_llama_dir)))
    await wait_until(lambda: len(engine_threads()) == len(before) + 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    release.set()  # the load finishes after its caller left: nobody steps it, it shuts down
    await wait_until(lambda: len(shut) == 1 and engine_threads() == before)


async def test_cancel_aborts_and_frees_blocks(tiny_llama_dir):
    engine = await AsyncEngine.create(make_config(tiny_llama_dir))
    try:
        ids = engine.tokenizer.encode("The quick brown fox")
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        started = asyncio.Event()

        async def consume(i):
            async for _ in engine.generate(EngineRequest(f"x{i}", ids, params)):
                started.set()

        tasks = [asyncio.create_task(consume(i)) for i in range(10)]
        await started.wait()
        await wait_until(lambda: engine.stats().kv_cache_usage > 0)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await wait_until(
            lambda: engine.stats().kv_cache_usage == 0.0 and engine.stats().num_running == 0
        )
        out = await collect(engine, "after", ids, SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
    finally:
        await engine.shutdown()


async def test_bad_input_and_queue_bound(tiny_llama_dir):
    engine = await AsyncEngine.create(
        make_config(tiny_llama_dir, max_num_seqs=1, max_num_queued_requests=1)
    )
    try:
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, "long", [5] * 300, SamplingParams(max_tokens=1))
        ids = engine.tokenizer.encode("Hello")
        slow = SamplingParams(max_tokens=150, ignore_eos=True)
        running = asyncio.create_task(collect(engine, "a", ids, slow))
        await wait_until(lambda: engine.stats().num_running == 1)
        queued = asyncio.create_task(collect(engine, "b", ids, slow))
        await wait_until(lambda: engine.stats().num_waiting == 1)
        with pytest.raises(QueueFullError):
            await collect(engine, "c", ids, slow)
        queued.cancel()
        running.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)
        await wait_until(
            lambda: engine.stats().num_waiting == 0 and engine.stats().num_running == 0
        )
    finally:
        await engine.shutdown()
    assert not engine.is_healthy()


async def test_queue_time_is_reported(tiny_llama_dir):
    engine = await AsyncEngine.create(make_config(tiny_llama_dir, max_num_seqs=1))
    try:
        ids = engine.tokenizer.encode("Hello")
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        first, second = await asyncio.gather(
            collect(engine, "q1", ids, params), collect(engine, "q2", ids, params)
        )
        # One seat: the second request waited while the first generated its 20 tokens.
        assert first.queue_time is not None and second.queue_time is not None
        assert second.queue_time > first.queue_time >= 0.0
    finally:
        await engine.shutdown()


async def collect_dated(engine, request_id, ids, params, deadline):
    outs = [
        o
        async for o in engine.generate(
            EngineRequest(request_id, ids, params, Tenancy(deadline=deadline))
        )
    ]
    return outs[-1]


class _EngineClock:
    """The engine's view of time.monotonic(), moved forward by the test: a deadline passes
    mid-generation however fast the machine is."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


async def test_a_request_past_its_deadline_ends_as_timeout_and_frees_its_blocks(
    tiny_llama_dir, monkeypatch
):
    import engine.llm_engine as llm_engine_module

    clock = _EngineClock()
    monkeypatch.setattr(llm_engine_module, "time", clock)
    engine = await AsyncEngine.create(make_config(tiny_llama_dir))
    try:
        ids = engine.tokenizer.encode("Hello world")
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        seen = []
        deadline = time.monotonic() + 600
        async for out in engine.generate(
            EngineRequest("slow", ids, long, Tenancy(tenant="t1", deadline=deadline))
        ):
            seen.append(out)
            if len(seen) == 3:
                clock.offset = 1200  # from the engine's next step on, the deadline has passed
        last = seen[-1]
        assert last.finished and last.outputs[0].finish_reason == "timeout"
        assert 0 < len(last.outputs[0].token_ids) < 200
        await wait_until(lambda: engine.stats().num_running == 0)
        assert engine.stats().kv_cache_usage == 0.0
        undated = await collect(engine, "undated", ids, long)  # no deadline: runs to the end
        assert undated.outputs[0].finish_reason == "length"
        # Already past its deadline when it arrives: ended before it computes anything.
        out = await collect_dated(engine, "dead", ids, long, time.monotonic() - 1)
        assert out.outputs[0].finish_reason == "timeout" and out.outputs[0].token_ids == []
        assert engine.stats().tenants["t1"][0] == len(ids)  # one lookup for tenant t1
    finally:
        await engine.shutdown()


async def test_fair_policy_serves_tenants_and_rejects_a_bad_weight(tiny_llama_dir):
    config = make_config(tiny_llama_dir)
    config.scheduler.policy = "fair"
    engine = await AsyncEngine.create(config)
    try:
        ids = engine.tokenizer.encode("Hello world")
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

        async def one(rid, tenant):
            last = None
            async for out in engine.generate(
                EngineRequest(rid, ids, params, Tenancy(tenant=tenant, weight=2.0))
            ):
                last = out
            return last

        outs = await asyncio.gather(*(one(f"r{i}", f"t{i % 2}") for i in range(6)))
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        tenants = engine.stats().tenants
        assert sorted(tenants) == ["t0", "t1"] and tenants["t0"][2] == 12
        with pytest.raises(ValueError, match="tenant_weight"):
            EngineRequest("bad", ids, params, Tenancy(tenant="t0", weight=0))
    finally:
        await engine.shutdown()


def test_an_engine_request_checks_its_own_invariants():
    with pytest.raises(ValueError, match="request_id"):
        EngineRequest("", [1, 2])
    with pytest.raises(ValueError, match="tenant_weight must be positive"):
        Tenancy(weight=-1.0)
    request = EngineRequest("r", [1, 2])
    assert request.tenancy == Tenancy() and request.adapter is None
