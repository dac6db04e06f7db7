"""Structured output through the engine (LLM on a tiny random model): outputs obey their
spec under greedy and random sampling, n > 1, preemption and prefix caching; unconstrained
neighbours are unchanged; a request waits for its grammar without holding up others."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
from structured_schemas import ALL

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.structured_output import GrammarError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=256)
    yield llm
    llm.shutdown()


def _no_leak(llm: LLM) -> None:
    assert llm.engine.scheduler.stats().kv_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def _check_json(outputs, schema) -> None:
    stopped = 0
    for out in outputs:
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(c.text), schema)
    total = sum(len(o.outputs) for o in outputs)
    assert stopped * 2 > total, f"only {stopped} of {total} closed their JSON"


@pytest.mark.parametrize("name", sorted(ALL))
def test_json_schema_outputs_validate(llm, name):
    schema = ALL[name]
    so = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(max_tokens=120, temperature=0, structured_outputs=so),
        SamplingParams(max_tokens=120, temperature=1.0, seed=3, n=2, structured_outputs=so),
        SamplingParams(max_tokens=120, temperature=0.7, top_k=20, structured_outputs=so),
    ]
    prompts = ["Hello world", "The capital of France", "Numbers: 1 2 3"]
    _check_json(llm.generate(prompts, params, use_tqdm=False), schema)
    _no_leak(llm)


def test_regex_choice_and_grammar(llm):
    forms = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), r"[0-9]{3}-[a-z]{2}"),
        (StructuredOutputsParams(choice=["yes", "no", "maybe so"]), r"yes|no|maybe so"),
        (StructuredOutputsParams(grammar='start: "ab" NUM\nNUM: /[0-9]{1,3}/'), r"ab[0-9]{1,3}"),
    ]
    for so, pattern in forms:
        params = SamplingParams(max_tokens=30, temperature=1.0, n=3, seed=5, structured_outputs=so)
        (out,) = llm.generate(["Hello"], params, use_tqdm=False)
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            assert re.fullmatch(pattern, c.text), c.text
    _no_leak(llm)


def test_length_when_max_tokens_runs_out(llm):
    so = StructuredOutputsParams(regex=r"[a-z]{50}")
    params = SamplingParams(max_tokens=3, structured_outputs=so)
    (out,) = llm.generate(["Hi"], params, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"
    assert re.fullmatch(r"[a-z]*", out.outputs[0].text)


def test_unconstrained_greedy_tokens_unchanged_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = ["Hello world", "The quick brown fox"]
    alone = llm.generate(prompts, [plain, plain], use_tqdm=False)
    so = StructuredOutputsParams(json=ALL["nested"])
    mixed = llm.generate(
        [*prompts, "Numbers", "Paris"],
        [
            plain,
            plain,
            SamplingParams(max_tokens=24, temperature=0, structured_outputs=so),
            SamplingParams(max_tokens=24, temperature=0.9, structured_outputs=so),
        ],
        use_tqdm=False,
    )
    for a, m in zip(alone, mixed[:2], strict=True):
        assert a.outputs[0].token_ids == m.outputs[0].token_ids


def test_preemption_keeps_the_grammar(tiny_llama_dir):
    # 16 blocks of 16 tokens for 8 requests of ~100 tokens each: recompute preemption.
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=17, max_model_len=128)
    try:
        schema = ALL["array"]
        so = StructuredOutputsParams(json=schema)
        params = SamplingParams(max_tokens=90, temperature=1.0, seed=1, structured_outputs=so)
        prompt = "The capital of France is Paris. " * 3  # shared prefix: cached blocks too
        outs = llm.generate([prompt + str(i) for i in range(8)], params, use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        _check_json(outs, schema)
        _no_leak(llm)
    finally:
        llm.shutdown()


def test_invalid_spec_raises_at_add(llm):
    bad = StructuredOutputsParams(regex="a{200}{200}")
    with pytest.raises(GrammarError, match="repeats"):
        llm.engine.add_request("bad", "Hello", SamplingParams(structured_outputs=bad))
    _no_leak(llm)


def test_a_request_waits_for_its_grammar_without_stalling_others(llm):
    engine = llm.engine
    manager = engine.structured
    release = threading.Event()
    real = manager._compile

    def slow(key):
        release.wait(30)
        return real(key)

    manager._compile = slow
    try:
        so = StructuredOutputsParams(regex=r"[xyz]{4}")  # not compiled yet by any test
        engine.add_request("slow", "Hello", SamplingParams(max_tokens=8, structured_outputs=so))
        # Compiling, it is waiting all the same: in the queue depth and the queue-full check.
        assert engine.num_waiting == 1 and engine.scheduler.num_waiting == 0
        assert [r.request_id for r in engine.awaiting_grammar] == ["slow"]
        engine.add_request("plain", "Hello", SamplingParams(max_tokens=4, ignore_eos=True))
        finished = {}
        while "plain" not in finished:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert "slow" not in finished and engine.has_unfinished_requests()
        release.set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert re.fullmatch("[xyz]{4}", finished["slow"].outputs[0].text)
        assert finished["slow"].outputs[0].finish_reason == "stop"
    finally:
        manager._compile = real
        release.set()
    _no_leak(llm)


def test_abort_while_waiting_for_the_grammar(llm):
    engine = llm.engine
    manager = engine.structured
    release = threading.Event()
    real = manager._compile
    manager._compile = lambda key: (release.wait(30), real(key))[1]
    try:
        so = StructuredOutputsParams(regex=r"[pq]{3}")
        engine.add_request("gone", "Hello", SamplingParams(structured_outputs=so))
        out = engine.abort_request("gone")
        assert out is not None and out.outputs[0].finish_reason == "abort"
    finally:
        manager._compile = real
        release.set()
    _no_leak(llm)


def test_a_compile_past_the_timeout_is_refused(llm):
    import asyncio
    import dataclasses

    from engine.async_engine import AsyncEngine

    engine = llm.engine
    manager = engine.structured
    release = threading.Event()
    real, limits = manager._compile, manager.limits
    manager._compile = lambda key: (release.wait(30), real(key))[1]
    manager.limits = dataclasses.replace(limits, compile_timeout_s=0.2)
    try:
        # The HTTP path: refused in bounded time, the compile left running (and cached).
        so = StructuredOutputsParams(regex=r"[rs]{5}")
        with pytest.raises(GrammarError, match="longer than 0.2 s"):
            asyncio.run(AsyncEngine(engine).compile_grammar(so))
        # The offline path: the waiting request fails with "error" once the limit passes.
        so2 = StructuredOutputsParams(regex=r"[tu]{5}")
        engine.add_request("late", "Hello", SamplingParams(structured_outputs=so2))
        final = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                final = out
        assert final.request_id == "late" and final.outputs[0].finish_reason == "error"
    finally:
        manager._compile, manager.limits = real, limits
        release.set()
    _no_leak(llm)
