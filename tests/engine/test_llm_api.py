"""The offline API (LLM.generate / LLM.chat) on a tiny random model, and on the default model."""

from __future__ import annotations

import math

import pytest

from engine import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, max_model_len=256)
    yield llm
    llm.shutdown()


def assert_no_leak(llm: LLM) -> None:
    assert llm.engine.scheduler.stats().kv_usage == 0.0
    assert not llm.engine.has_unfinished_requests()


def test_text_and_token_prompts_agree(llm):
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    text_out = llm.generate("Hello world", params, use_tqdm=False)[0]
    ids = llm.tokenizer.encode("Hello world")
    ids_out = llm.generate([ids], params, use_tqdm=False)[0]
    assert text_out.prompt_token_ids == ids == ids_out.prompt_token_ids
    assert text_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
    assert text_out.outputs[0].finish_reason == "length"
    assert text_out.outputs[0].text == llm.tokenizer.decode(text_out.outputs[0].token_ids)
    assert_no_leak(llm)


def test_outputs_keep_prompt_order_and_per_prompt_params(llm):
    prompts = ["a", "The capital of France", "Numbers: 1 2 3"]
    params = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (3, 9, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 9, 5]


def test_seeded_sampling_ignores_batch_composition(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = llm.generate(["Tessera serves"], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=14, temperature=1.0, ignore_eos=True)
    batch = llm.generate(
        ["The quick brown fox", "Tessera serves", "Hello"],
        [others, params, others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone


def test_logprobs_shape(llm):
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    comp = llm.generate("Hello", params, use_tqdm=False)[0].outputs[0]
    assert len(comp.logprobs) == 4
    for tok, lp in zip(comp.token_ids, comp.logprobs, strict=True):
        assert lp.token_id == tok and lp.rank == 1  # greedy picks the most likely
        assert len(lp.top) == 3 and lp.top[0][0] == tok
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    assert math.isclose(comp.cumulative_logprob, sum(lp.logprob for lp in comp.logprobs))


def test_stop_string_is_cut_from_text(llm):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    full = llm.generate("The", params, use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 4
    stop = full.text[2:4]
    cut = llm.generate(
        "The", SamplingParams(max_tokens=16, temperature=0, stop=[stop]), use_tqdm=False
    )
    comp = cut[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == full.text[: full.text.index(stop)]
    assert_no_leak(llm)


def test_stop_token_text_is_not_output(llm):
    """The token that ends a request (eos, a stop_token_id) keeps its id but not its text, as
    in vLLM, also with skip_special_tokens off; include_stop_str_in_output keeps the text."""
    tok = llm.tokenizer
    eos = tok.eos_token_id
    base = dict(max_tokens=8, temperature=0, min_tokens=3, skip_special_tokens=False)
    ended = SamplingParams(**base, logit_bias={eos: 100.0})
    comp = llm.generate("The", ended, use_tqdm=False)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.token_ids[-1] == eos
    assert comp.text == tok.decode(comp.token_ids[:-1], skip_special_tokens=False)
    kept = SamplingParams(**base, logit_bias={eos: 100.0}, include_stop_str_in_output=True)
    comp = llm.generate("The", kept, use_tqdm=False)[0].outputs[0]
    assert comp.text.endswith(tok.decode([eos], skip_special_tokens=False))
    full = llm.generate("The", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    stop_id = full[0].outputs[0].token_ids[4]
    by_id = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[stop_id])
    comp = llm.generate("The", by_id, use_tqdm=False)[0].outputs[0]
    assert comp.token_ids[-1] == stop_id and comp.stop_reason == stop_id
    assert comp.text == tok.decode(comp.token_ids[:-1])
    assert_no_leak(llm)


def test_chat_applies_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "Hello"}], SamplingParams(max_tokens=2), use_tqdm=False
    )
    expected = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    assert out[0].prompt_token_ids == expected


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "empty"),
        ([1] * 300, SamplingParams(max_tokens=1), "maximum context length is 256"),
        ([1] * 200, SamplingParams(max_tokens=100), "max_tokens asks for 100 more"),
        ([10**6], SamplingParams(), "out of range"),
    ],
)
def test_bad_input_raises_and_engine_still_serves(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], params, use_tqdm=False)
    assert_no_leak(llm)
    out = llm.generate("Hello", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(n=1000), "n must be"),
        (dict(temperature=-1), "temperature"),
    ],
)
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_params_in_a_batch_queue_nothing(llm):
    good = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError):
        llm.generate(["ok", [10**6]], [good, good], use_tqdm=False)
    assert_no_leak(llm)


@pytest.mark.slow
def test_default_model_knows_paris():
    llm = LLM(max_model_len=512)
    out = llm.chat(
        [{"role": "user", "content": "Name the capital of France."}],
        SamplingParams(max_tokens=32, temperature=0),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
    llm.shutdown()
