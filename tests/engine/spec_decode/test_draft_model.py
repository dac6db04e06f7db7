"""Draft-model speculative decoding end to end on tiny random Llamas sharing one tokenizer:
greedy output token for token the same as without it (a smaller draft that often disagrees,
and the target as its own draft, which must have every draft accepted), across preemption,
prefix hits, stop strings and chunked prefill; the sampling distribution unchanged
(chi-square) with a disagreeing draft; no KV block leaked; the refusals."""

from __future__ import annotations

import json

import pytest
import torch

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def draft_dir(make_tiny_model):
    """One layer, narrower, another seed: the same tokenizer and vocabulary as tiny-llama."""
    return make_tiny_model(
        "tiny-llama-draft",
        seed=7,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )


@pytest.fixture(scope="module")
def noisy_draft_dir(tiny_llama_dir, tmp_path_factory):
    """The target with noise on every weight: its argmax agrees with the target's often,
    not always (both the accepted and the residual draws are exercised)."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("noisy-draft") / "model"
    shutil.copytree(tiny_llama_dir, folder)
    g = torch.Generator().manual_seed(2)
    for f in folder.glob("*.safetensors"):
        tensors = load_file(f)
        noisy = {
            k: (t + torch.randn(t.shape, generator=g) * t.float().std() * 0.1).contiguous()
            for k, t in tensors.items()
        }
        save_file(noisy, f, metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def vocab(tiny_llama_dir):
    return json.loads((tiny_llama_dir / "config.json").read_text())["vocab_size"]


def _spec(path, k=3):
    # drafts at every step: the drafting itself is under test (the controller: test_controller.py)
    return {"model": str(path), "num_speculative_tokens": k, "adaptive": False}


def _prompts(vocab: int, count: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (4 + 5 * i,), generator=g).tolist() for i in range(count)]


def _run(model_dir, prompts, params, spec, second_wave=None, **kwargs):
    """Generate; then second_wave's prompts (same params) on the same engine, whose blocks
    from the first are cached: prefix hits on blocks the draft filled earlier."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        speculative_config=spec,
        async_scheduling=False,
        **kwargs,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    engine = llm.engine
    if second_wave is not None:
        outs += llm.generate(second_wave, params[: len(second_wave)], use_tqdm=False)
        m = engine.scheduler.kv_cache_manager
        assert m.prefix_cache_hits > 0, "no prefix hit: the second wave proves nothing"
    stats = engine.scheduler.stats().spec_decoding
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    total = engine.num_blocks - 1
    preemptions = engine.scheduler.num_preemptions
    llm.shutdown()
    result = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    return result, stats, free, total, preemptions


# Engine settings under test: a roomy cache; a tight one (9 blocks: preemption) with a
# 32-token budget (prompts chunked to fit the step); no prefix caching.
CASES = {
    "plain": {},
    "preempt-chunked": {"num_kv_blocks": 9, "max_model_len": 128, "max_num_batched_tokens": 32},
    "no-prefix-cache": {"enable_prefix_caching": False},
}
_REFERENCE: dict[str, tuple] = {}  # case -> plain decoding's outputs (shared by the tests)


def _greedy_case(tiny_llama_dir, vocab, case):
    """The prompts (one shares the fifth's first block), params, second wave (prefix hits
    on the first wave's cached blocks) and plain decoding's outputs for a case."""
    kwargs = CASES[case]
    prompts = _prompts(vocab)
    prompts.append(prompts[4] + prompts[1][:3])
    params = [
        SamplingParams(max_tokens=20 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    wave = [p + [9] for p in prompts[3:]] if kwargs.get("enable_prefix_caching", True) else None
    if case not in _REFERENCE:
        _REFERENCE[case] = _run(tiny_llama_dir, prompts, params, None, wave, **kwargs)[0]
    return prompts, params, wave, _REFERENCE[case]


@pytest.mark.parametrize("case", ["preempt-chunked", "no-prefix-cache"])
def test_greedy_identical(tiny_llama_dir, draft_dir, vocab, case):
    """A smaller draft of other weights: drafts accepted and rejected, output unchanged."""
    prompts, params, wave, ref = _greedy_case(tiny_llama_dir, vocab, case)
    spec = {**_spec(draft_dir), "draft_backoff": False}  # draft at every step: both outcomes
    got, stats, free, total, preempted = _run(
        tiny_llama_dir, prompts, params, spec, wave, **CASES[case]
    )
    assert got == ref
    assert stats.num_draft_tokens > 0
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert free == total  # every block back (cached ones count as free)
    if "num_kv_blocks" in CASES[case]:
        assert preempted > 0, "the tight case preempted nobody"


@pytest.mark.parametrize("case", ["plain", "preempt-chunked"])
def test_target_as_its_own_draft_accepts_everything(tiny_llama_dir, vocab, case):
    """The draft's K/V follows every kept token through prefill chunks, prefix hits, rejected
    positions and preemption: a draft equal to the target is then never wrong."""
    prompts, params, wave, ref = _greedy_case(tiny_llama_dir, vocab, case)
    got, stats, free, total, preempted = _run(
        tiny_llama_dir, prompts, params, _spec(tiny_llama_dir, 4), wave, **CASES[case]
    )
    assert got == ref
    assert stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens == stats.num_draft_tokens
    assert free == total
    if "num_kv_blocks" in CASES[case]:
        assert preempted > 0, "the tight case preempted nobody"


def test_target_and_draft_steps_replay_in_cuda_graphs(
    tiny_llama_dir, draft_dir, vocab, monkeypatch
):
    """CUDA graphs' logic on the CPU (graphs_testing.py): the target's verification steps in
    its verify graphs (1 + k tokens a request), the draft's one-token steps in its decode
    graphs and its feeds after a verification (up to k + 2 tokens) in its own verify graphs;
    plain decoding's tokens, across chunked prefill and preemption."""
    from graphs_testing import REPLAY, step_graphs

    prompts = _prompts(vocab)
    params = [
        SamplingParams(max_tokens=16 + i, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    kwargs = {"dtype": "float32", "async_scheduling": False, "attention_backend": "torch",
              "num_kv_blocks": 9, "max_model_len": 128, "max_num_batched_tokens": 32,
              "max_num_seqs": 4}  # fmt: skip
    llm = LLM(str(tiny_llama_dir), **kwargs)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    spec = {**_spec(draft_dir, 3), "draft_backoff": False}
    monkeypatch.setenv(*REPLAY)
    llm = LLM(str(tiny_llama_dir), speculative_config=spec, **kwargs)
    target, draft = step_graphs(llm)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    stats = llm.engine.scheduler.stats().spec_decoding
    preempted = llm.engine.scheduler.num_preemptions
    llm.shutdown()
    assert got == ref
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert preempted > 0, "the tight cache preempted nobody"
    assert (target.verify_len, draft.verify_len) == (4, 5)
    assert sum(target.verify_runs.values()) >= 10
    assert sum(draft.runs.values()) >= 10  # drafts 2..k
    assert sum(draft.verify_runs.values()) >= 10  # the feeds after verification steps


def test_greedy_stops_and_limits(tiny_llama_dir, draft_dir, vocab):
    """Stop strings, stop token ids, min_tokens, logprobs and penalties give what plain
    decoding gives; requests with and without drafts share steps (n > 1, a seed)."""
    prompts = _prompts(vocab, 6)
    base = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    llm = LLM(str(tiny_llama_dir), dtype="float32", async_scheduling=False)
    tokens = llm.generate(prompts[:1], base, use_tqdm=False)[0].outputs[0].token_ids
    head, more = llm.tokenizer.decode(tokens[:10]), llm.tokenizer.decode(tokens[:14])
    stop = more[len(head) :].strip()[:3] or more[-2:]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[tokens[12]]),
        SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=10, repetition_penalty=1.2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    ref = [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]
    got, stats, free, total, _ = _run(tiny_llama_dir, prompts, params, _spec(draft_dir))
    assert got == ref
    assert stats.num_draft_tokens > 0
    assert free == total


def test_sampling_distribution_unchanged(tiny_llama_dir, noisy_draft_dir, vocab):
    """Temperature 1, top-k 5, a draft that often disagrees: the joint distribution of the
    first two tokens and those of the third and fourth are those of plain sampling (2 x K chi-square,
    significance 0.001, 300 draws each, fixed seeds: deterministic)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stats_testing import chi2_critical, two_sample

    prompt = _prompts(vocab, 3)[2]
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=5, ignore_eos=True)
    draws = {}
    for seed, spec in ((0, None), (1, _spec(noisy_draft_dir, 2))):
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
    assert stats.num_drafts >= 290
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for part in (lambda t: t[:2], lambda t: t[2], lambda t: t[3]):
        stat, df = two_sample([part(t) for t in draws[False]], [part(t) for t in draws[True]])
        assert stat < chi2_critical(df), (stat, df)


def test_refusals(tiny_llama_dir, make_tiny_model):
    other = make_tiny_model("tiny-llama-other-vocab", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens"):
        LLM(str(tiny_llama_dir), dtype="float32", speculative_config=_spec(other))
    with pytest.raises(ValueError, match="speculative_config: the draft model '/nonexistent"):
        LLM(str(tiny_llama_dir), dtype="float32", speculative_config=_spec("/nonexistent/d"))
    from engine.args import EngineArgs

    with pytest.raises(ValueError, match="pipeline_parallel_size > 1"):
        EngineArgs(
            model=str(tiny_llama_dir),
            pipeline_parallel_size=2,
            speculative_config=_spec(tiny_llama_dir),
        ).create_engine_config()
    config = EngineArgs(  # tensor parallelism: the draft runs whole on the driver
        model=str(tiny_llama_dir),
        tensor_parallel_size=2,
        speculative_config=_spec(tiny_llama_dir),
    ).create_engine_config()
    assert config.scheduler.speculative_config.method == "draft_model"
    # or split like the target: draft_tensor_parallel_size 1 or the target's, a draft model's
    for spec, tp in (
        ({"model": str(tiny_llama_dir), "draft_tensor_parallel_size": 2}, 4),
        ({"method": "eagle", "model": str(tiny_llama_dir), "draft_tensor_parallel_size": 2}, 2),
    ):
        with pytest.raises(ValueError, match="draft_tensor_parallel_size 2 must be 1"):
            EngineArgs(
                model=str(tiny_llama_dir), tensor_parallel_size=tp, speculative_config=spec
            ).create_engine_config()


def test_kv_budget_prices_a_block_at_both_models(tiny_llama_dir, draft_dir):
    """The same bytes hold fewer blocks with a draft: a block costs the target's layers plus
    the draft's (tiny-llama: 3 layers of 2 KV heads x 16; the draft: 1 layer of 1 x 16)."""
    budget = 4 << 20
    blocks = []
    for spec in (None, _spec(draft_dir)):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            kv_cache_memory=budget,
            speculative_config=spec,
            async_scheduling=False,
        )
        runner = llm.engine.executor.runner
        per_layer = runner.kv_cache_spec().bytes_per_block  # target: 2 heads x 16
        blocks.append(llm.engine.num_blocks)
        if spec is not None:
            assert runner.drafter.kv_block_bytes() == per_layer // 2
            assert len(runner.drafter.kv_caches) == 1
            assert runner.drafter.kv_caches[0].shape[1] == llm.engine.num_blocks
        llm.shutdown()
    assert blocks == [budget // (3 * per_layer), budget // (3 * per_layer + per_layer // 2)]
