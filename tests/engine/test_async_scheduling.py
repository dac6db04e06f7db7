"""Async scheduling (engine.async_scheduling) against the synchronous loop: the same tokens,
texts, finish reasons and usage for a mixed batch (lengths, max_tokens, stop token ids, stop
strings, seeded sampling, n=2, penalties, min_tokens, logprobs, an abort mid-run, prefix-cache
hits),
with preemption and chunked prefill, and no KV block leaked."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.async_scheduling import needs_sync, resolve_async_scheduling
from engine.outputs import ScheduledRequest, SchedulerOutput
from engine.protocol import EngineRequest
from engine.request import Request

ABORT_AT = 5  # request 6 is aborted once it has this many tokens


def _prompts(vocab_size: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    lengths = (5, 17, 33, 48, 9, 26, 12)
    first = [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lengths]
    shared = torch.randint(3, vocab_size, (20,), generator=g).tolist()
    # The last of the first wave puts the shared prefix in the cache for the second wave.
    first.append(shared + [5, 6, 7])
    second = [shared + torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in (7, 13)]
    return first, second


@pytest.fixture(scope="module")
def workload(tiny_llama_dir):
    """Prompts and parameters; the stop token and stop string come from a greedy run, so
    that they occur mid-output."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=False)
    first, second = _prompts(llm.engine.vocab_size)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(first[2:4], greedy, use_tqdm=False)]
    tok = llm.tokenizer
    head, more = tok.decode(ref[1][:6]), tok.decode(ref[1][:9])
    stop = more[len(head) :].strip()[:3] or more[-2:]
    llm.shutdown()
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=7),
        SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ref[0][5]]),
        SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=2),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3),
        SamplingParams(max_tokens=12, temperature=0.7, seed=5, min_tokens=4),
        SamplingParams(max_tokens=1, temperature=0.0),
    ]
    second_params = [
        SamplingParams(max_tokens=9, temperature=0.0),
        SamplingParams(max_tokens=11, temperature=0.8, seed=11),
    ]
    return (first, params), (second, second_params)


def run(model_dir, workload, async_scheduling: bool, **kwargs):
    """Each wave to the end (request 6 aborted at ABORT_AT tokens); the second wave's shared
    prefix is cached by then. Returns each request's samples and the engine."""
    llm = LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling, **kwargs)
    engine = llm.engine
    assert engine.async_scheduling is async_scheduling
    results = {}
    for wave, (prompts, params) in enumerate(workload):
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            engine.add_request(f"{wave}-{i}", prompt, sp)
        while engine.has_unfinished_requests():
            for out in engine.step():
                n = len(out.outputs[0].token_ids)
                if out.request_id == "0-6" and not out.finished and n >= ABORT_AT:
                    out = engine.abort_request("0-6")
                if out.finished:
                    results[out.request_id] = out
    samples = {
        rid: [
            (c.token_ids, c.text, c.finish_reason, c.stop_reason, len(c.logprobs or ()))
            for c in out.outputs
        ]
        for rid, out in results.items()
    }
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.num_free_blocks == engine.num_blocks - 1, "KV blocks leaked"
    assert not engine.scheduler.requests
    stats = engine.scheduler.stats()
    usage = sum(len(c.token_ids) for out in results.values() for c in out.outputs)
    assert engine.generation_tokens_total == usage  # a dropped placeholder is never counted
    llm.shutdown()
    return samples, usage, stats


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),  # prefix caching on, one step for all
        dict(num_kv_blocks=9, max_model_len=128, max_num_batched_tokens=32),  # preempts, chunks
    ],
    ids=["default", "preemption-chunked"],
)
def test_async_matches_sync(tiny_llama_dir, workload, kwargs):
    sync, sync_usage, sync_stats = run(tiny_llama_dir, workload, False, **kwargs)
    asyn, asyn_usage, asyn_stats = run(tiny_llama_dir, workload, True, **kwargs)
    assert set(asyn) == set(sync) and len(sync) == 10
    for rid in sync:
        assert asyn[rid] == sync[rid], rid
    assert asyn_usage == sync_usage
    # The workload reaches what it is meant to.
    assert sync["0-2"][0][2] == "stop" and sync["0-2"][0][3] is not None
    assert sync["0-3"][0][2] == "stop" and isinstance(sync["0-3"][0][3], str)
    assert sync["0-6"][0][2] == "abort" and len(sync["0-6"][0][0]) == ABORT_AT
    assert len(sync["0-4"]) == 2 and sync["0-0"][0][4] == 3  # n=2; a logprob per token
    assert asyn_stats.prefix_cache_hits >= 16
    if kwargs:
        assert sync_stats.num_preemptions > 0 and asyn_stats.num_preemptions > 0


def test_resolve_async_scheduling():
    assert resolve_async_scheduling(None, "cuda", 1) is True
    assert resolve_async_scheduling(None, "cpu", 1) is False
    assert resolve_async_scheduling(None, "cuda", 2) is False
    assert resolve_async_scheduling(True, "cpu", 1) is True
    assert resolve_async_scheduling(False, "cuda", 1) is False
    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        resolve_async_scheduling(True, "cuda", 2)


def test_needs_sync_for_host_dependent_requests():
    def so(*rows):
        return SchedulerOutput([ScheduledRequest(r, 4, 1, [], s, k) for r, s, k in rows], 3)

    requests = {
        "plain": Request("plain", [1, 2], SamplingParams()),
        "pen": Request("pen", [1, 2], SamplingParams(presence_penalty=0.5)),
        "fork": Request("fork", [1, 2], SamplingParams(n=2)),
    }
    assert not needs_sync(so(("plain", True, 1)), requests)
    assert not needs_sync(so(("pen", False, 1)), requests)  # a prefill chunk: nothing sampled
    assert needs_sync(so(("plain", True, 1), ("pen", True, 1)), requests)
    assert needs_sync(so(("fork", True, 2)), requests)
    assert not needs_sync(so(("gone", True, 1)), requests)  # finished since


def test_structured_output_matches_sync(tiny_llama_dir):
    """Constrained requests force synchronous steps (their bitmask needs the last token);
    their unconstrained neighbours still run ahead: the same outputs either way."""
    from engine import StructuredOutputsParams

    regex = StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}")
    choice = StructuredOutputsParams(choice=["yes", "no", "maybe so"])
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=regex),
        SamplingParams(max_tokens=20, temperature=1.0, seed=5, structured_outputs=choice),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0.8, seed=2, ignore_eos=True),
    ]
    prompts = ["Hello", "The capital of France", "Numbers: 1 2 3", "abc"]
    texts = {}
    for mode in (False, True):
        llm = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        texts[mode] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]
        assert llm.engine.scheduler.stats().kv_usage == 0.0
        llm.shutdown()
    assert texts[True] == texts[False]
    assert texts[False][0][1] == texts[False][1][1] == "stop"


async def test_async_engine_streams_and_cancels(tiny_llama_dir):
    """The serving loop (AsyncEngine's thread) with async scheduling: streams complete and
    equal, cancelled requests free their blocks, and the engine goes on serving."""
    import asyncio

    from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.async_engine import AsyncEngine

    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=32, max_model_len=256, async_scheduling=True),
    )
    engine = await AsyncEngine.create(config)
    try:
        assert engine.engine.async_scheduling
        ids = engine.tokenizer.encode("Hello world")
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

        async def last(rid, p):
            result = None
            async for out in engine.generate(EngineRequest(rid, ids, p)):
                result = out
            return result

        outs = await asyncio.gather(*(last(f"s{i}", params) for i in range(4)))
        assert all(list(o.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids) for o in outs)
        assert len(outs[0].outputs[0].token_ids) == 6
        long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        tasks = [asyncio.create_task(last(f"c{i}", long)) for i in range(4)]
        while engine.stats().generation_tokens_total < 24 + 8:
            await asyncio.sleep(0.01)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(500):
            stats = engine.stats()
            if stats.kv_cache_usage == 0.0 and stats.num_running == 0:
                break
            await asyncio.sleep(0.01)
        assert stats.kv_cache_usage == 0.0 and stats.num_running == 0
        again = await last("after", params)
        assert again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    finally:
        await engine.shutdown()
