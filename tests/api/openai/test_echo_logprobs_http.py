"""/v1/completions with echo and logprobs (the prompt's tokens first, the first one's null),
echo with max_tokens 0 (lm-eval's loglikelihood shape), vLLM's prompt_logprobs field on
completions and chat, and best_of: over HTTP with the openai SDK against a real server,
against the offline LLM's computation on the same model."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from engine import LLM, SamplingParams

KEY = "sk-test-key"
MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, "--served-model-name", MODEL, "--api-key", KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, max_model_len=512)
    yield llm
    llm.shutdown()


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)


def test_echo_with_logprobs_matches_offline(client, llm):
    ids = llm.tokenizer.encode(PROMPT)
    params = SamplingParams(
        max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2, ignore_eos=True
    )
    ref = llm.generate([ids], params, use_tqdm=False)[0]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=3,
        temperature=0,
        echo=True,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    gen = ref.outputs[0]
    assert c.text == PROMPT + gen.text
    lp = c.logprobs
    n_prompt = len(ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    want = [e.logprob for e in ref.prompt_logprobs[1:]] + [e.logprob for e in gen.logprobs]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    tok = llm.tokenizer
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids + gen.token_ids]
    for entry, top in zip(ref.prompt_logprobs[1:], lp.top_logprobs[1:n_prompt], strict=True):
        assert len(top) <= 2
        best = max(top.values())
        assert best == pytest.approx(entry.top[0][1], abs=1e-4)
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 3


def test_echo_with_logprobs_streamed_is_the_same(client):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = client.completions.create(**body).choices[0]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(stream=True, **body):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert values == whole.logprobs.token_logprobs


def test_max_tokens_zero_echo_gives_the_prompt_alone(server, llm):
    """lm-eval's local-completions request: token-id prompts, echo, logprobs, max_tokens 0."""
    prompts = [llm.tokenizer.encode(PROMPT), llm.tokenizer.encode("Hello there, world")]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    refs = llm.generate(prompts, params, use_tqdm=False)
    body = {
        "model": MODEL,
        "prompt": prompts,
        "max_tokens": 0,
        "temperature": 0,
        "logprobs": 1,
        "echo": True,
        "seed": 1234,
    }
    r = post(server, body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    for ids, ref, c in zip(prompts, refs, choices, strict=True):
        assert c["text"] == llm.tokenizer.decode(ids, skip_special_tokens=False)
        lp = c["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids)
        assert lp["token_logprobs"][0] is None
        want = [e.logprob for e in ref.prompt_logprobs[1:]]
        assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # without echo, max_tokens 0 stays a 400
    r = post(server, {**body, "echo": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_field_completions_and_chat(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    ref = llm.generate(
        [ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2), use_tqdm=False
    )[0]
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    r = post(server, body)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for pos, (entry, d) in enumerate(zip(ref.prompt_logprobs[1:], got[1:], strict=True), 1):
        mine = d[str(ids[pos])]
        assert mine["logprob"] == pytest.approx(entry.logprob, abs=1e-4)
        assert mine["rank"] == entry.rank
        for rank, (tid, v) in enumerate(entry.top, start=1):
            assert d[str(tid)]["logprob"] == pytest.approx(v, abs=1e-4)
            if tid != ids[pos]:
                assert d[str(tid)]["rank"] == rank
    # absent unless asked
    assert (
        "prompt_logprobs"
        not in post(server, {**body, "prompt_logprobs": None}).json()["choices"][0]
    )
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        "prompt_logprobs": 0,
    }
    r = post(server, chat, "/v1/chat/completions")
    assert r.status_code == 200, r.text
    got = r.json()["prompt_logprobs"]
    assert got[0] is None and all(len(d) == 1 for d in got[1:])
    r = post(server, {**chat, "stream": True}, "/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_best_of_returns_the_most_likely_samples(client, server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    sp = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, logprobs=0, ignore_eos=True)
    ref = llm.generate([ids], sp, use_tqdm=False)[0]
    ranked = sorted(ref.outputs, key=lambda c: -c.cumulative_logprob)
    r = client.completions.create(
        model=MODEL,
        prompt=ids,
        max_tokens=6,
        temperature=1.0,
        seed=11,
        n=2,
        best_of=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in r.choices)  # not asked for
    assert r.usage.completion_tokens == 4 * 6  # every sample generated counts
    # invalid combinations
    base = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    err = post(server, {**base, "n": 3, "best_of": 2}).json()["error"]
    assert err["param"] == "best_of" and "n" in err["message"]
    err = post(server, {**base, "best_of": 3, "stream": True}).json()["error"]
    assert err["param"] == "best_of" and "stream" in err["message"]
    assert post(server, {**base, "best_of": 2, "n": 2, "stream": True}).status_code == 200
    err = post(server, {**base, "best_of": 17}).json()["error"]
    assert err["param"] == "best_of"


def sse_chunks(server, body: dict) -> list[dict]:
    headers = {"Authorization": f"Bearer {KEY}"}
    url = server.base_url + "/v1/completions"
    r = httpx.post(url, json={**body, "stream": True}, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    lines = [ln[len("data: ") :] for ln in r.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streamed_prompt_logprobs_and_echo_only(server, llm):
    ids = llm.tokenizer.encode(PROMPT)
    body = {"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 1}
    whole = post(server, body).json()["choices"][0]["prompt_logprobs"]
    chunks = sse_chunks(server, body)
    carried = [
        c["choices"][0]["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c["choices"][0]
    ]
    assert carried == [whole]  # once, in the choice's first chunk
    echo = {"model": MODEL, "prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    chunks = sse_chunks(server, echo)
    text = "".join(c["choices"][0]["text"] for c in chunks)
    values = [
        v
        for c in chunks
        if c["choices"][0]["logprobs"]
        for v in c["choices"][0]["logprobs"]["token_logprobs"]
    ]
    assert text == llm.tokenizer.decode(ids, skip_special_tokens=False)
    assert len(values) == len(ids) and values[0] is None
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
