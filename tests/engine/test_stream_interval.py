"""--stream-interval: a request's output goes out with its first token, every N new tokens a
sample, and when it finishes (engine.output_processor); the tokens and text it ends with are
the every-token stream's, through the engine's step loop and through AsyncEngine."""

from __future__ import annotations

import pytest

from engine import LLM, CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.async_engine import AsyncEngine
from engine.protocol import EngineRequest


def _steps(llm: LLM, params: SamplingParams):
    """Each output the step loop returns for one request (its samples' token counts), and
    the last output."""
    engine = llm.engine
    engine.add_request("r", list(range(20, 32)), params)
    seen, last = [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append([len(c.token_ids) for c in out.outputs])
            last = out
    return seen, last


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    kw = dict(device="cpu", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    made = {n: LLM(str(tiny_llama_dir), stream_interval=n, **kw) for n in (1, 4)}
    yield made
    for llm in made.values():
        llm.shutdown()


def test_outputs_come_with_the_first_token_every_n_and_the_finish(engines):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    every, last_every = _steps(engines[1], params)
    fewer, last_fewer = _steps(engines[4], params)
    assert every == [[n] for n in range(1, 11)]
    assert fewer == [[1], [5], [9], [10]]
    assert (
        last_fewer.finished and last_fewer.outputs[0].token_ids == last_every.outputs[0].token_ids
    )
    assert last_fewer.outputs[0].text == last_every.outputs[0].text


def test_n_samples_count_per_sample_and_a_stop_string_finishes_at_once(engines):
    params = SamplingParams(max_tokens=9, temperature=1.0, seed=3, n=2, ignore_eos=True)
    seen, _ = _steps(engines[4], params)
    assert seen == [[1, 1], [5, 5], [9, 9]]
    # a stop string the first three tokens spell ends the request inside the interval: its
    # output goes out at once
    _, three = _steps(engines[1], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    stop = three.outputs[0].text[-2:]
    assert stop
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, stop=[stop])
    stopped, last = _steps(engines[4], params)
    assert last.finished and last.outputs[0].finish_reason == "stop"
    assert stopped[0] == [1] and stopped[-1][0] <= 3 and len(stopped) <= 2


async def test_the_async_engine_streams_fewer_chunks_ending_the_same(tiny_llama_dir):
    finals = {}
    for interval in (1, 4):
        config = EngineConfig(
            model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256, stream_interval=interval),
        )
        engine = await AsyncEngine.create(config)
        try:
            params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
            seen = []
            async for out in engine.generate(EngineRequest("r", list(range(20, 32)), params)):
                seen.append(len(out.outputs[0].token_ids))
        finally:
            await engine.shutdown()
        # the stream may skip an output its reader had not taken yet, never the last
        assert seen[-1] == 10 and seen == sorted(set(seen))
        if interval == 4:
            assert set(seen) <= {1, 5, 9, 10}
        finals[interval] = (out.outputs[0].token_ids, out.outputs[0].text)
    assert finals[4] == finals[1]


def test_a_stream_interval_below_one_is_refused():
    with pytest.raises(ValueError, match="stream_interval must be at least 1"):
        SchedulerConfig(stream_interval=0)
