"""ProcessEngine: the engine core in a child process (engine/core_process.py). Its streams
against the in-thread AsyncEngine's (the same greedy tokens, cumulative outputs), the checks
a request passes in the parent, grammars compiled in the child, the snapshot and block map
across the pipe, an abort freeing the child's blocks, a child that dies (the streams fail, the
listeners hear it, health says so), a load that fails, and no child left after shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal

import pytest

from engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.async_engine import AsyncEngine
from engine.core_process import ProcessEngine
from engine.errors import EngineDeadError
from engine.protocol import EngineClient, EngineRequest
from engine.sampling_params import StructuredOutputsParams
from engine.structured_output import GrammarError

PROMPT = list(range(20, 32))


def make_config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=256, device="cpu"),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256),
    )


async def collect(engine, request_id: str, params: SamplingParams, prompt=PROMPT):
    seen, last = [], None
    async for out in engine.generate(EngineRequest(request_id, list(prompt), params)):
        seen.append(list(out.outputs[0].token_ids))
        last = out
    return seen, last


@pytest.fixture(scope="module")
def thread_tokens(tiny_llama_dir):
    """The in-thread engine's greedy outputs for four prompts (the reference)."""

    async def run():
        engine = await AsyncEngine.create(make_config(tiny_llama_dir))
        try:
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            done = await asyncio.gather(
                *(collect(engine, f"t{i}", params, PROMPT[i:]) for i in range(4))
            )
            return [last.outputs[0].token_ids for _, last in done]
        finally:
            await engine.shutdown()

    return asyncio.run(run())


async def test_streams_match_the_in_thread_engine(tiny_llama_dir, thread_tokens):
    engine = await ProcessEngine.create(make_config(tiny_llama_dir))
    pid = engine._proc.pid
    try:
        assert isinstance(engine, EngineClient) and pid != os.getpid()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        done = await asyncio.gather(
            *(collect(engine, f"p{i}", params, PROMPT[i:]) for i in range(4))
        )
        assert [last.outputs[0].token_ids for _, last in done] == thread_tokens
        for seen, last in done:
            assert last.finished and last.outputs[0].text
            for a, b in zip(seen, seen[1:], strict=False):
                assert b[: len(a)] == a  # cumulative
        stats = engine.stats()
        assert stats.generation_tokens_total == 32 and stats.kv_cache_usage == 0.0
        assert engine.is_healthy() and engine.tokenizer.decode(PROMPT)
        # the parent checks a request before its first await, as AsyncEngine does
        with pytest.raises(ValueError, match="out of range"):
            await collect(engine, "bad", params, [10**6])
        with pytest.raises(ValueError, match="maximum context length"):
            await collect(engine, "long", SamplingParams(max_tokens=300), PROMPT)
        # the console's snapshot and block map come across the pipe
        assert await engine.request_infos() == []
        blocks = await engine.block_states()
        assert len(blocks) == stats.num_blocks and set(blocks) <= {0, 1, 2}
    finally:
        await engine.shutdown()
    assert engine._proc.exitcode == 0 and not engine._proc.is_alive()


async def test_grammars_compile_in_the_child(tiny_llama_dir):
    engine = await ProcessEngine.create(make_config(tiny_llama_dir))
    try:
        with pytest.raises(GrammarError):
            await engine.compile_grammar(StructuredOutputsParams(regex="(unclosed"))
        so = StructuredOutputsParams(choice=["yes", "no"])
        await engine.compile_grammar(so)
        params = SamplingParams(max_tokens=8, temperature=0, structured_outputs=so)
        _, last = await collect(engine, "g", params)
        assert last.outputs[0].text in ("yes", "no")
    finally:
        await engine.shutdown()


async def test_an_abandoned_stream_is_aborted_in_the_child(tiny_llama_dir):
    engine = await ProcessEngine.create(make_config(tiny_llama_dir))
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = engine.generate(EngineRequest("long", list(PROMPT), params))
        await anext(stream)
        (info,) = await engine.request_infos()  # read in the child between its steps
        assert info.request_id == "long" and info.status == "running" and info.num_blocks > 0
        await stream.aclose()  # the client went away
        for _ in range(100):
            if engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats().num_running == 0 and engine.stats().kv_cache_usage == 0.0
    finally:
        await engine.shutdown()


async def test_a_killed_child_is_a_dead_engine(tiny_llama_dir):
    engine = await ProcessEngine.create(make_config(tiny_llama_dir))
    heard: list[EngineDeadError] = []
    engine.on_dead(heard.append)
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        stream = engine.generate(EngineRequest("r", list(PROMPT), params))
        await anext(stream)
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="engine process exited"):
            async for _ in stream:
                pass
        for _ in range(100):
            if heard:
                break
            await asyncio.sleep(0.05)
        assert heard and not engine.is_healthy() and engine.dead_error is not None
        with pytest.raises(EngineDeadError):
            await collect(engine, "after", params)
    finally:
        await engine.shutdown()
    assert not engine._proc.is_alive()


async def test_a_failed_load_raises_and_leaves_no_child(tmp_path):
    config = make_config(tmp_path / "no-such-model")
    with pytest.raises(Exception) as info:
        await ProcessEngine.create(config)
    assert "no-such-model" in str(info.value) or "exited" in str(info.value)
    assert not [p for p in multiprocessing.active_children() if p.name == "tessera-engine-core"]


async def test_two_clients_share_one_core(tiny_llama_dir, thread_tokens):
    """--api-server-count's core: a second client attached through its own channel. Each gets
    its own requests' outputs (the same greedy tokens as in a thread), requests from both run
    in one batch, a client that detaches has its requests aborted while the other's go on, and
    the owner's shutdown stops the core."""
    from engine.core_process import core_channel

    core_ends, client_ends = core_channel()
    owner = await ProcessEngine.create(make_config(tiny_llama_dir), peers=[core_ends])
    assert core_ends[0].closed and core_ends[1].closed  # handed to the child
    other = await ProcessEngine.attach(client_ends)
    try:
        assert other._proc is None and other.is_healthy()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        done = await asyncio.gather(
            *(collect(owner if i % 2 else other, f"c{i}", params, PROMPT[i:]) for i in range(4))
        )
        assert [last.outputs[0].token_ids for _, last in done] == thread_tokens
        assert [last.request_id for _, last in done] == ["c0", "c1", "c2", "c3"]
        # both clients hear the engine's stats
        assert owner.stats().generation_tokens_total == other.stats().generation_tokens_total == 32

        # the other client leaves mid-stream: its request is aborted, the owner's goes on
        long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
        longest = SamplingParams(max_tokens=240, temperature=0, ignore_eos=True)
        theirs = other.generate(EngineRequest("theirs", list(PROMPT), longest))
        await anext(theirs)
        mine = asyncio.ensure_future(collect(owner, "mine", long))
        await other.shutdown()  # returns once the core dropped it (after the abort)
        assert "theirs" not in [info.request_id for info in await owner.request_infos()]
        with pytest.raises(EngineDeadError):  # its stream ends when it detaches
            async for _ in theirs:
                pass
        _, last = await mine
        assert last.finished and len(last.outputs[0].token_ids) == 120
        for _ in range(100):
            if owner.stats().kv_cache_usage == 0.0:
                break
            await asyncio.sleep(0.05)
        assert owner.stats().num_running == 0 and owner.stats().kv_cache_usage == 0.0
        assert owner.is_healthy() and owner._proc.is_alive()
    finally:
        await other.shutdown()
        await owner.shutdown()
    assert owner._proc.exitcode == 0
