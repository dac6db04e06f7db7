"""Pipeline parallelism on the multiprocessing executor: the layers split into stages that
pass hidden states point to point (gloo), the last stage samples. Greedy tokens equal the
single-process engine's at PP=2 and TP=2 x PP=2, with chunked prefill, prefix hits and
preemption (a small KV pool); each stage holds only its layers' weights and KV cache."""

from __future__ import annotations

import pytest
import torch

from engine.models.pipeline import PARTITION_ENV, layer_partition, layer_range


def test_layer_partition_balanced_and_override(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    assert layer_partition(3, 2) == [2, 1]  # the remainder before the last stage
    assert layer_partition(8, 4) == [2, 2, 2, 2]
    assert layer_partition(10, 4) == [2, 3, 3, 2]
    assert layer_partition(3, 1) == [3]
    assert layer_range(10, 2, 4) == (5, 8)
    assert layer_partition(3, 2, override="1,2") == [1, 2]
    monkeypatch.setenv(PARTITION_ENV, "1,2")
    assert layer_range(3, 1, 2) == (1, 3)
    for bad in ("1,1", "3,0", "a,b", "1,1,1"):
        with pytest.raises(ValueError, match=PARTITION_ENV):
            layer_partition(3, 2, override=bad)
    monkeypatch.delenv(PARTITION_ENV)
    with pytest.raises(ValueError, match="more than the model's 3 layers"):
        layer_partition(3, 4)


def test_pipeline_parallel_size_is_an_engine_option():
    from engine.args import EngineArgs

    config = EngineArgs(pipeline_parallel_size=2, tensor_parallel_size=2).create_engine_config()
    assert config.parallel.pipeline_parallel_size == 2 and config.parallel.world_size == 4
    with pytest.raises(ValueError, match="pipeline_parallel_size must be at least 1"):
        EngineArgs(pipeline_parallel_size=0).create_engine_config()


PROMPTS = [
    list(range(10, 60)),
    list(range(100, 137)),
    [3, 9, 27, 81],
    list(range(200, 219)),
    list(range(10, 50)) + [7, 7, 7],  # shares 5 blocks with the first: a prefix hit
]


def _params():
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
    params[3] = SamplingParams(n=2, max_tokens=20, temperature=0.0, ignore_eos=True)
    return params


def _generate(model_dir, tp: int = 1, pp: int = 1, check=None, **extra):
    from engine import LLM

    # A small pool and budget: chunked prefill and preemption on both sides.
    options = dict(
        dtype="float32",
        num_kv_blocks=24,
        block_size=8,
        max_model_len=128,
        max_num_batched_tokens=32,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        device="cpu",
    )
    llm = LLM(str(model_dir), **{**options, **extra})
    # the most batches already in flight when one was submitted; preemptions meanwhile
    in_flight = [0, 0]
    if pp > 1:
        engine, submit = llm.engine, llm.engine.executor.submit

        def counting_submit(so):
            in_flight[0] = max(in_flight[0], len(engine._batches))
            return submit(so)

        engine.executor.submit = counting_submit
        schedule = engine.scheduler.schedule

        def watching_schedule():
            so = schedule()
            if so.preempted_request_ids and engine._batches:
                in_flight[1] += 1  # a preemption while batches were in flight
            return so

        engine.scheduler.schedule = watching_schedule
    try:
        first = llm.generate(PROMPTS[:1], _params()[:1], use_tqdm=False)  # cached for the 5th
        outs = first + llm.generate(PROMPTS[1:], _params()[1:], use_tqdm=False)
        stats = llm.engine.scheduler.stats()
        info = None
        group = llm.engine.executor.workers
        if pp > 1 and group.driver is not None:
            info = (group.driver.num_layers, len(group.driver.kv_caches), *in_flight)
        if check is not None:
            check(llm)
    finally:
        llm.shutdown()
    return [[c.token_ids for c in o.outputs] for o in outs], stats, info


CHOICES = ["yes", "no", "maybe so"]


def _structured(llm) -> list[str]:
    """Constrained replies: the bitmask, filled in the engine's process, travels with the
    step to the last stage, which samples."""
    from engine import SamplingParams
    from engine.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(choice=CHOICES)
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=so)
    outs = llm.generate([[5, 6], [7, 8, 9], list(range(30, 50))], params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def _sampled_with_logprobs(llm) -> list:
    """Seeded random samples with their top-3 logprobs (the last stage's sampler)."""
    from engine import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.8, seed=11, logprobs=3, ignore_eos=True)
    out = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0]
    return [out.token_ids, out.logprobs]


@pytest.mark.slow
def test_pp2_engine_greedy_equals_one_process(tiny_llama_dir):
    torch.set_num_threads(1)
    sampled: list = []
    texts: list = []

    def check(llm) -> None:
        sampled.append(_sampled_with_logprobs(llm))
        texts.append(_structured(llm))

    want, stats, _ = _generate(tiny_llama_dir, check=check)
    assert stats.num_preemptions > 0

    got, stats, info = _generate(tiny_llama_dir, pp=2, check=check)
    assert got == want
    assert texts[1] == texts[0] and all(t in CHOICES for t in texts[1])
    (want_tokens, want_lps), (tokens, lps) = sampled
    assert tokens == want_tokens and len(lps) == 6  # the seeded draw, on the last stage
    for mine, theirs in zip(lps, want_lps, strict=True):
        assert mine.token_id == theirs.token_id and mine.rank == theirs.rank
        assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
        assert mine.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    # The driver's stage: layers 0-1 of 3, and only their KV cache; two batches in flight.
    assert info[:3] == (2, 2, 1)


@pytest.mark.slow
def test_pp2_stages_replay_in_cuda_graphs(tiny_llama_dir, monkeypatch):
    """CUDA graphs' logic for pipeline stages on the CPU (TESSERA_STEP_GRAPH=replay, in the
    driver and in the worker process): the first stage's graphs return its hidden states and
    residual, the last stage's read them from static buffers at the padded rows; greedy
    tokens of one eager process through chunked prefill, preemption and a prefix hit, and
    both stages' graphs took every step (32-token steps: the prefill chunks piecewise)."""
    torch.set_num_threads(1)
    kw = {"attention_backend": "torch", "max_num_seqs": 8}
    want, _, _ = _generate(tiny_llama_dir, **kw)
    monkeypatch.setenv("TESSERA_STEP_GRAPH", "replay")
    stats: list = []

    def check(llm) -> None:
        stats.extend(llm.engine.executor.workers.stage_stats())

    got, run_stats, _ = _generate(tiny_llama_dir, pp=2, check=check, **kw)
    assert got == want
    assert run_stats.num_preemptions > 0
    assert [s.pp_rank for s in stats] == [0, 1]
    assert all(s.graph_steps >= 20 for s in stats), stats
    assert all(s.graph_steps == s.steps for s in stats)


@pytest.mark.slow
def test_pp2_ngram_speculation_equals_one_process(tiny_llama_dir):
    """N-gram drafts under PP = 2: the last stage verifies them (the rank that samples) and
    its kept tokens come back in its reply; greedy tokens of one process without drafts,
    through chunked prefill, preemption and a prefix hit, with drafts accepted. A draft
    model stays refused under PP (the first stage's driver never holds a step's tokens)."""
    torch.set_num_threads(1)
    from engine.args import EngineArgs

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "adaptive": False}  # fmt: skip
    want, _, _ = _generate(tiny_llama_dir)
    got, stats, _ = _generate(tiny_llama_dir, pp=2, speculative_config=spec)
    assert got == want
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decoding.num_accepted_tokens <= stats.spec_decoding.num_draft_tokens
    with pytest.raises(ValueError, match="takes the ngram method only"):
        EngineArgs(
            model=str(tiny_llama_dir),
            pipeline_parallel_size=2,
            speculative_config={"model": str(tiny_llama_dir), "num_speculative_tokens": 2},
        ).create_engine_config()


@pytest.mark.slow
def test_tp2_pp2_engine_greedy_equals_one_process(tiny_llama_dir):
    """Four ranks: two stages of two TP ranks (a TP group per stage), each TP rank sending
    to its counterpart in the next stage."""
    torch.set_num_threads(1)
    want, _, _ = _generate(tiny_llama_dir)
    got, stats, info = _generate(tiny_llama_dir, tp=2, pp=2)
    assert got == want
    assert stats.num_preemptions > 0 and info[:3] == (2, 2, 1)


@pytest.mark.slow
def test_pp2_tied_embeddings_and_a_layer_partition(tiny_qwen2_dir, tiny_mixtral_dir, monkeypatch):
    """Qwen2 ties the LM head to the embedding: the last stage, which has no embedding,
    loads its own head from the embedding's tensor. TESSERA_PP_LAYER_PARTITION moves the
    split (the driver keeps one layer); a mixture of experts splits the same way."""
    torch.set_num_threads(1)
    for model_dir in (tiny_qwen2_dir, tiny_mixtral_dir):
        want, _, _ = _generate(model_dir)
        monkeypatch.setenv(PARTITION_ENV, "1,2")  # the spawned workers inherit it
        got, _, info = _generate(model_dir, pp=2)
        monkeypatch.delenv(PARTITION_ENV)
        assert got == want
        assert info[:3] == (1, 1, 1)


def test_ray_is_imported_only_when_chosen(monkeypatch):
    import subprocess
    import sys

    code = (
        "import sys; from engine import LLM; import engine.worker.executor; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    from engine.worker.ray_executor import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ValueError, match=r"pip install 'tessera\[ray\]'"):
        import_ray()


@pytest.mark.slow
def test_pp3_three_batches_in_flight(tiny_llama_dir):
    """Three stages of one layer each, up to three batches in flight: a preemption while
    batches are in flight collects them first (a preempted request's token must be back
    before it is scheduled again)."""
    torch.set_num_threads(1)
    small = dict(max_num_batched_tokens=8, num_kv_blocks=20)  # few tokens a batch: more batches
    want, _, _ = _generate(tiny_llama_dir, **small)
    got, stats, info = _generate(tiny_llama_dir, pp=3, **small)
    assert got == want
    assert stats.num_preemptions > 0 and info[:3] == (1, 1, 2)
    assert info[3] > 0  # and requests preempted while batches were in flight


@pytest.mark.slow
async def test_pp2_through_the_async_engine(tiny_llama_dir):
    """The server's path: concurrent streams through AsyncEngine at PP=2 end with the
    offline engine's greedy tokens (the step loop's thread drives the batch queue)."""
    import asyncio

    from engine import EngineArgs, SamplingParams
    from engine.async_engine import AsyncEngine
    from engine.protocol import EngineRequest

    torch.set_num_threads(1)
    prompts = PROMPTS[:4]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    async def run(pp: int) -> list[list[int]]:
        config = EngineArgs(
            model=str(tiny_llama_dir),
            dtype="float32",
            num_kv_blocks=64,
            block_size=8,
            max_model_len=128,
            max_num_batched_tokens=32,
            pipeline_parallel_size=pp,
            device="cpu",
        ).create_engine_config()
        engine = await AsyncEngine.create(config)

        async def one(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(EngineRequest(f"r{i}", prompts[i], params)):
                tokens = out.outputs[0].token_ids
            return tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await engine.shutdown()

    assert await run(2) == await run(1)
