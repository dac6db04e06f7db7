"""A request nobody streams (EngineRequest.streamed False: a whole HTTP answer) gets its first
output and its last, the same tokens as a streamed one; and abort(wait=True) hands back the
final output of a request whose stream ended first (every token the engine made: what a
closing Generation bills), on the in-thread engine and across the engine process's pipe."""

from __future__ import annotations

import asyncio

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.core_process import ProcessEngine
from engine.protocol import EngineRequest
from tests.engine.test_core_process import PROMPT, make_config

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    made = LLM(str(tiny_llama_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    yield made
    made.shutdown()


def _outputs(llm: LLM, request: EngineRequest):
    engine = llm.engine
    engine.add(request)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_a_whole_answer_gets_its_first_and_last_outputs(llm):
    streamed = _outputs(llm, EngineRequest("s", list(PROMPT), GREEDY))
    whole = _outputs(llm, EngineRequest("w", list(PROMPT), GREEDY, streamed=False))
    assert len(streamed) == 10
    assert [len(o.outputs[0].token_ids) for o in whole] == [1, 10]
    assert whole[-1].finished and whole[-1].outputs[0] == streamed[-1].outputs[0]
    samples = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=5, ignore_eos=True)
    whole = _outputs(llm, EngineRequest("n", list(PROMPT), samples, streamed=False))
    assert [[len(c.token_ids) for c in o.outputs] for o in whole] == [[1, 1], [6, 6]]


def test_generate_asks_for_whole_answers(llm):
    """LLM.generate keeps only final outputs: the engine makes no output a step for its
    requests (a cumulative copy of each one's tokens, every step), the same tokens."""
    engine, seen = llm.engine, []
    step = engine.step

    def counted_step():
        outs = step()
        seen.extend(outs)
        return outs

    engine.step = counted_step
    try:
        (out,) = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    finally:
        del engine.step  # the instance attribute: the class's method again
    assert [len(o.outputs[0].token_ids) for o in seen] == [1, 10]
    assert (
        out.outputs[0] == _outputs(llm, EngineRequest("ref", list(PROMPT), GREEDY))[-1].outputs[0]
    )


@pytest.mark.parametrize("kind", [AsyncEngine, ProcessEngine], ids=["thread", "process"])
async def test_an_abort_that_waits_returns_every_token_made(tiny_llama_dir, kind):
    engine = await kind.create(make_config(tiny_llama_dir))
    try:
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        request = EngineRequest("gone", list(PROMPT), params, streamed=False)
        stream = engine.generate(request)
        first = await anext(stream)
        assert len(first.outputs[0].token_ids) == 1
        while engine.stats().generation_tokens_total < 12:  # it runs on meanwhile
            await asyncio.sleep(0.01)
        await stream.aclose()  # the client went away: the stream ends before the request
        final = await engine.abort("gone", wait=True)
        assert final is not None and final.finished
        assert final.outputs[0].finish_reason == "abort"
        made = engine.stats().generation_tokens_total
        assert 12 <= len(final.outputs[0].token_ids) <= made
        assert final.outputs[0].token_ids[0] == first.outputs[0].token_ids[0]
        # collected once; an abort of a request the engine never had waits and gives nothing
        assert await engine.abort("gone", wait=True) is None
        assert await engine.abort("never", wait=True) is None
        assert await engine.abort("never") is None
        assert not engine._finals and not engine._abandoned
        # an abort that does not wait: nothing is kept for it (nobody will ask)
        stream = engine.generate(EngineRequest("left", list(PROMPT), params))
        await anext(stream)
        await stream.aclose()
        await engine.abort("left")
        while engine.stats().num_running:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # its final output reached the loop meanwhile
        assert not engine._finals and not engine._abandoned
    finally:
        await engine.shutdown()
    # after shutdown nothing would answer: it does not wait
    assert await asyncio.wait_for(engine.abort("late", wait=True), 5) is None
