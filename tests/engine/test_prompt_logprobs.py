"""SamplingParams.prompt_logprobs: each prompt token's logprob given the ones before it (and
the top k), against HF transformers' log_softmax over the prompt (fp32): in one chunk and
across chunked-prefill chunks, with prefix caching on (no hit for such a request), beside
requests that do not ask, and with n > 1."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPTS = [
    "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes up.",
    "Tessera serves language models to many people at once.",
    "a",
]


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits: row i is the distribution of token i + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_against_hf(ref: torch.Tensor, prompt: list[int], got, k: int) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for i in range(1, len(prompt)):
        entry = got[i]
        want = ref[i - 1]
        assert entry.token_id == prompt[i]
        assert entry.logprob == pytest.approx(float(want[prompt[i]]), abs=1e-4)
        assert entry.rank == int((want > want[prompt[i]]).sum()) + 1
        assert len(entry.top) == k
        top_v, top_i = want.topk(k)
        for (tid, lp), v in zip(entry.top, top_v.tolist(), strict=True):
            assert lp == pytest.approx(v, abs=1e-4)
            assert float(want[tid]) == pytest.approx(lp, abs=1e-4)
        assert [t for t, _ in entry.top][:1] == top_i.tolist()[:1] or k == 0


@pytest.fixture(scope="module")
def chunked(tiny_llama_dir):
    # 16 tokens a step: the long prompt spans several chunks; prefix caching on.
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=256,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
    )
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def refs(tiny_llama_dir, chunked):
    prompts = [chunked.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [hf_prompt_logprobs(tiny_llama_dir, p) for p in prompts]


def test_prompt_logprobs_match_hf_across_chunks(chunked, refs):
    prompts, ref = refs
    assert len(prompts[0]) > 32  # spans chunks of 16
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, ignore_eos=True)
    outs = chunked.generate(prompts, params, use_tqdm=False)
    for prompt, r, out in zip(prompts, ref, outs, strict=True):
        check_against_hf(r, prompt, out.prompt_logprobs, 3)
        assert len(out.outputs[0].token_ids) == 2


def test_prefix_cache_hit_still_gets_full_prompt_logprobs(chunked, refs):
    prompts, ref = refs
    plain = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    warm = chunked.generate([prompts[0]], plain, use_tqdm=False)[0]
    assert warm.prompt_logprobs is None
    again = chunked.generate([prompts[0]], plain, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0  # the prompt's blocks are cached
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    out = chunked.generate([prompts[0]], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_against_hf(ref[0], prompts[0], out.prompt_logprobs, 0)


def test_mixed_batch_and_n(chunked, refs):
    prompts, ref = refs
    asks = SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2, prompt_logprobs=1)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = chunked.generate([prompts[1], prompts[0]], [asks, plain], use_tqdm=False)
    check_against_hf(ref[1], prompts[1], outs[0].prompt_logprobs, 1)
    assert len(outs[0].outputs) == 2
    assert outs[1].prompt_logprobs is None


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"async_scheduling": True},
        pytest.param(
            {"tensor_parallel_size": 2, "device": "cpu", "max_num_batched_tokens": 16},
            marks=pytest.mark.slow,
            id="tp2-chunked",
        ),
    ],
    ids=lambda o: "-".join(o) or "default",
)
def test_one_step_async_and_tp(tiny_llama_dir, refs, options):
    prompts, ref = refs
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, **options)
    try:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for prompt, r, out in zip(prompts, ref, outs, strict=True):
        check_against_hf(r, prompt, out.prompt_logprobs, 2)


def test_validation():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def _plan_prompt_logprobs(path, plan: bool, monkeypatch, rows: int):
    """A prompt_logprobs request fed one prompt token a step beside rows - 1 decoding requests
    (max_num_batched_tokens rows): its prompt rows run in steps of `rows` rows of one token
    each, which the CPU decode plan takes."""
    monkeypatch.setenv("TESSERA_DECODE_PLAN", "1" if plan else "0")
    llm = LLM(
        str(path), dtype="bfloat16", quantization="w4a8", num_kv_blocks=128,
        enable_prefix_caching=False, max_num_seqs=rows, max_num_batched_tokens=rows, block_size=8,
    )  # fmt: skip
    try:
        engine = llm.engine
        decoders = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i in range(rows - 1):
            engine.add_request(f"d{i}", [5 + i, 6 + i], decoders)
        for _ in range(3):  # their prefills done: rows - 1 decode rows a step from here on
            engine.step()
        asks = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
        prompt = list(range(50, 70))
        engine.add_request("p", prompt, asks)
        got = None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == "p" and out.finished:
                    got = out.prompt_logprobs
        graph = engine.executor.runner._step_graph
        runs = None if graph is None else dict(graph.runs)
    finally:
        llm.shutdown()
    return [None] + [(e.token_id, e.logprob, e.rank, e.top) for e in got[1:]], runs


@pytest.mark.parametrize("rows", [8, 16])
def test_prompt_rows_in_the_cpu_decode_plan(make_tiny_model, monkeypatch, rows):
    """The decode plan returns every row's final hidden state, so prompt rows it runs give
    the modules' prompt logprobs. 8 rows: its 4-bit steps (its int8 ones with AMX); 16: its
    int8-activation steps, which need the packed int8 GEMM (below 13 rows w4a8 stays 4-bit)."""
    from engine.kernels.cpu import w4 as cpu_w4
    from engine.kernels.cpu import w8a8 as cpu_w8a8

    if not cpu_w4.available():
        pytest.skip("the plan runs the 4-bit (AVX512-VNNI or AVX2) kernels")
    if rows == 16 and not cpu_w8a8.packed_available():
        pytest.skip("no packed int8 GEMM on this CPU (AVX2): the modules run w4a8's 16-row steps")
    path = make_tiny_model("tiny-llama-plan", seed=3)
    with_plan, runs = _plan_prompt_logprobs(path, True, monkeypatch, rows)
    without, no_runs = _plan_prompt_logprobs(path, False, monkeypatch, rows)
    assert no_runs is None
    assert runs is not None and runs.get(rows, 0) >= 19, runs  # the prompt's one-token steps
    assert len(with_plan) == 20
    assert with_plan == without


def test_recompute_preemption_keeps_one_full_copy(tiny_llama_dir, refs):
    """A pool too small for all: requests are preempted and recomputed; each still gets its
    prompt logprobs once, whole and right."""
    prompts, ref = refs
    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=9, max_model_len=128,
        max_num_batched_tokens=32,
    )  # fmt: skip
    try:
        params = SamplingParams(max_tokens=40, temperature=0, prompt_logprobs=1, ignore_eos=True)
        outs = llm.generate(prompts * 2, params, use_tqdm=False)
        assert llm.engine.scheduler.stats().num_preemptions > 0
    finally:
        llm.shutdown()
    for prompt, r, out in zip(prompts * 2, ref * 2, outs, strict=True):
        check_against_hf(r, prompt, out.prompt_logprobs, 1)
