"""N-gram speculative decoding end to end on the tiny Llama: greedy output token for token
the same as without it (copy-heavy prompts so drafts are proposed and accepted, checked in
the stats), across preemption, prefix hits, stop strings, chunked prefill and max_tokens; the
first sampled token's distribution unchanged (chi-square); no KV block leaked."""

from __future__ import annotations

import pytest
import torch
from graphs_testing import REPLAY, step_graphs

from engine import LLM, SamplingParams

# drafts at every step: the drafting itself is under test (the controller: test_controller.py
# and test_greedy_identical_with_the_controller)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False}


def _copy_prompts(vocab_size: int, count: int = 6) -> list[list[int]]:
    """Prompts that repeat a random sequence a few times, so the n-gram lookups hit."""
    g = torch.Generator().manual_seed(3)
    prompts = []
    for i in range(count):
        unit = torch.randint(3, vocab_size, (5 + 3 * i,), generator=g).tolist()
        prompts.append(unit * (2 + i % 3) + unit[:2])
    return prompts


def _run(model_dir, prompts, params, spec: bool, probe: dict | None = None, **kwargs):
    """probe, if given: the CUDA graph runner the steps went through (graphs_testing.py:
    TESSERA_STEP_GRAPH=replay) is left in probe["graphs"], the preemptions in
    probe["preempted"]."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        speculative_config=(SPEC if spec is True else spec) or None,
        async_scheduling=False,
        **kwargs,
    )
    if probe is not None:
        probe["graphs"] = step_graphs(llm)[0]
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    stats = engine.scheduler.stats().spec_decoding
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    total = engine.num_blocks - 1
    if probe is not None:
        probe["preempted"] = engine.scheduler.num_preemptions
    llm.shutdown()
    result = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    return result, stats, free, total


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir):
    import json

    return json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"num_kv_blocks": 12, "max_model_len": 128},  # preemption
        {"max_num_batched_tokens": 16, "max_model_len": 256},  # chunked prefill, tight budget
        {"enable_prefix_caching": False},
    ],
    ids=["plain", "preempt", "chunked", "no-prefix-cache"],
)
def test_greedy_identical(tiny_llama_dir, vocab, kwargs):
    prompts = _copy_prompts(vocab)
    prompts.append(prompts[0] + prompts[1][:4])  # a prefix hit on the first prompt's blocks
    params = [
        SamplingParams(max_tokens=24 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref, _, _, _ = _run(tiny_llama_dir, prompts, params, spec=False, **kwargs)
    got, stats, free, total = _run(tiny_llama_dir, prompts, params, spec=True, **kwargs)
    assert got == ref
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens > 0, "no draft was accepted: the test proves nothing"
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert free == total  # every block back (cached ones count as free)
    for outs in got:
        for token_ids, _, _ in outs:
            assert len(token_ids) <= 24 + len(prompts)


def test_verification_steps_replay_in_cuda_graphs(tiny_llama_dir, vocab, monkeypatch):
    """CUDA graphs' logic on the CPU: verification steps through the verify graphs (every
    request padded to 1 + k tokens, requests without drafts too) and decode steps through
    the decode graphs give plain decoding's tokens, across preemption."""
    prompts = _copy_prompts(vocab)
    params = [
        SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    kwargs = {"num_kv_blocks": 10, "max_model_len": 128, "max_num_seqs": 4,
              "attention_backend": "torch"}  # fmt: skip
    ref, _, _, _ = _run(tiny_llama_dir, prompts, params, spec=False, **kwargs)
    monkeypatch.setenv(*REPLAY)
    probe: dict = {}
    got, stats, free, total = _run(tiny_llama_dir, prompts, params, True, probe, **kwargs)
    assert got == ref
    assert stats.num_accepted_tokens > 0 and free == total
    assert probe["preempted"] > 0, "the tight cache preempted nobody"
    g = probe["graphs"]
    assert g.verify_len == 4 and g.verify_ladder == (1, 2, 4)
    assert sum(g.verify_runs.values()) >= 10 and sum(g.runs.values()) >= 10


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_blocks": 12, "max_model_len": 128},  # preemption
        {"max_num_batched_tokens": 16, "max_model_len": 256},  # chunked prefill, tight budget
    ],
    ids=["preempt", "chunked"],
)
def test_greedy_identical_with_the_controller(tiny_llama_dir, vocab, kwargs):
    """The draft controller on (the default: it times the real steps, so which steps draft
    varies from run to run): greedy output token for token plain decoding's under preemption
    and chunked prefill, the first decode step of each batch size drafting (its warm-up)."""
    prompts = _copy_prompts(vocab)
    params = [
        SamplingParams(max_tokens=24 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    ref, _, _, _ = _run(tiny_llama_dir, prompts, params, spec=False, **kwargs)
    on = {k: v for k, v in SPEC.items() if k != "adaptive"}
    got, stats, free, total = _run(tiny_llama_dir, prompts, params, spec=on, **kwargs)
    assert got == ref
    assert stats.num_draft_tokens > 0
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens <= stats.num_draft_tokens
    assert free == total


def test_greedy_stops_and_limits(tiny_llama_dir, vocab):
    """Stop strings, stop token ids, min_tokens, logprobs and penalties cut or shape the
    accepted drafts exactly as they cut non-speculative decoding."""
    prompts = _copy_prompts(vocab, 4)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    ref, _, _, _ = _run(tiny_llama_dir, prompts[:1], [base], spec=False)
    tokens, text, _ = ref[0][0]
    llm_tok = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=False)
    tok = llm_tok.tokenizer
    llm_tok.shutdown()
    head, more = tok.decode(tokens[:10]), tok.decode(tokens[:14])
    stop = more[len(head) :].strip()[:3] or more[-2:]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[tokens[12]]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, repetition_penalty=1.2),
    ]
    ref, _, _, _ = _run(tiny_llama_dir, prompts, params, spec=False)
    got, stats, free, total = _run(tiny_llama_dir, prompts, params, spec=True)
    assert got == ref
    assert stats.num_accepted_tokens > 0
    assert free == total


def test_greedy_identical_under_grammars(tiny_llama_dir, vocab):
    """Structured output with n-gram drafts: the drafts cut to what each request's grammar
    allows, every verified position sampled under its own mask (the state after the drafts
    before it): the same tokens, texts and logprobs as without speculation, beside plain
    requests in the same steps; the constrained requests' drafts kept (alone); no block
    leaked."""
    from engine.sampling_params import StructuredOutputsParams as S

    answer = '{"name": "tessera", "items": [12, 7, 3], "ok": true}'
    llm_tok = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=False)
    ids = llm_tok.tokenizer.encode(f"{answer}\n{answer}\n", add_special_tokens=False)
    llm_tok.shutdown()
    regex = r'\{"name": "[a-z]{1,12}", "items": \[[0-9]{1,2}, [0-9]{1,2}, [0-9]{1,2}\], "ok": (true|false)\}'
    prompts = [ids, ids[3:], *_copy_prompts(vocab, 2), ids]
    params = [
        SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=S(choice=[answer])),
        SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=S(regex=regex)),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(
            max_tokens=80, temperature=0.0, logprobs=2, structured_outputs=S(choice=[answer])
        ),
    ]
    ref, _, _, _ = _run(tiny_llama_dir, prompts, params, spec=False)
    got, stats, free, total = _run(tiny_llama_dir, prompts, params, spec=True)
    assert got == ref
    assert ref[0][0][1] == answer and ref[4][0][1] == answer
    assert free == total
    constrained = [0, 1, 4]
    got, stats, _, _ = _run(
        tiny_llama_dir, [prompts[i] for i in constrained], [params[i] for i in constrained], True
    )
    assert got == [ref[i] for i in constrained]
    assert stats.num_accepted_tokens > 0


def test_logprobs_match(tiny_llama_dir, vocab):
    prompts = _copy_prompts(vocab, 2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = []
    for spec in (False, True):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            speculative_config=SPEC if spec else None,
            async_scheduling=False,
        )
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
    for a, b in zip(*outs, strict=True):
        la, lb = a.outputs[0].logprobs, b.outputs[0].logprobs
        assert [x.token_id for x in la] == [x.token_id for x in lb]
        assert [x.rank for x in la] == [x.rank for x in lb]
        for x, y in zip(la, lb, strict=True):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_sampling_distribution_unchanged(tiny_llama_dir, vocab):
    """Temperature 1, top-k 5: the joint distribution of the first two tokens and that of
    the third are the same with and without speculation (2 x K chi-square, significance
    0.001, 300 draws each, fixed engine seeds: deterministic). The prompt holds every
    token once, so each decode step after the first gets a draft: mostly rejected (the
    residual draw), some accepted."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stats_testing import chi2_critical, two_sample

    g = torch.Generator().manual_seed(0)
    perm = [t for t in torch.randperm(vocab, generator=g).tolist() if t > 10]
    prompt = perm + [perm[5]] * 8
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=5, ignore_eos=True)
    draws = {}
    for seed, spec in ((0, None), (1, {**SPEC, "num_speculative_tokens": 2})):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            speculative_config=spec,
            async_scheduling=False,
            seed=seed,
        )
        outs = llm.generate([prompt] * 300, params, use_tqdm=False)
        draws[spec is not None] = [tuple(o.outputs[0].token_ids) for o in outs]
        stats = llm.engine.scheduler.stats().spec_decoding
        llm.shutdown()
    assert stats.num_drafts >= 290 and stats.num_accepted_tokens > 0
    for part in (lambda t: t[:2], lambda t: t[2]):
        stat, df = two_sample([part(t) for t in draws[False]], [part(t) for t in draws[True]])
        assert stat < chi2_critical(df), (stat, df)


async def test_async_engine_streams_and_counts(tiny_llama_dir, vocab):
    """Through AsyncEngine (the server's engine): streamed outputs grow by the accepted
    drafts, the text is the greedy one, and the stats snapshot carries the counters."""
    from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from engine.async_engine import AsyncEngine
    from engine.protocol import EngineRequest
    from engine.spec_decode import parse_speculative_config

    prompt = _copy_prompts(vocab, 1)[0]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    ref, _, _, _ = _run(tiny_llama_dir, [prompt], params, spec=False)
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(
            max_model_len=256, speculative_config=parse_speculative_config(SPEC)
        ),
    )
    engine = await AsyncEngine.create(config)
    try:
        seen = []
        async for out in engine.generate(EngineRequest("r", prompt, params)):
            seen.append(list(out.outputs[0].token_ids))
        assert seen[-1] == ref[0][0][0] and out.outputs[0].text == ref[0][0][1]
        assert len(seen) < 20  # some steps emitted several tokens
        stats = engine.stats()
        assert stats.spec_decode_num_accepted_tokens > 0
        assert sum(stats.spec_decode_accepted_per_pos) == stats.spec_decode_num_accepted_tokens
        assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    finally:
        await engine.shutdown()


def test_async_scheduling_is_turned_off(tiny_llama_dir):
    """Auto async scheduling gives way to speculation; asking for both is refused."""
    with pytest.raises(ValueError, match="async scheduling"):
        LLM(str(tiny_llama_dir), dtype="float32", speculative_config=SPEC, async_scheduling=True)
    llm = LLM(str(tiny_llama_dir), dtype="float32", speculative_config=SPEC)
    assert llm.engine.async_scheduling is False
    assert llm.engine.config.scheduler.async_scheduling is False
    llm.shutdown()
