"""The OpenAI-compatible server, end to end: a real `tessera serve` process on loopback,
driven by the real openai SDK (sync and async) and raw httpx where the SDK hides details.

One server for the module (static API key, tiny random Llama, float32 for determinism).
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

KEY = "sk-test-key"
MODEL = "tiny"
MAX_LEN = 512


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(
        tiny_llama_dir, "--served-model-name", MODEL, "--api-key", KEY, "--max-body-size", "64KiB"
    )


@pytest.fixture(scope="module")
def hf_tok(tiny_llama_dir):
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(
        base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60
    )


def raw(server, method: str, path: str, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
    return httpx.request(method, server.base_url + path, headers=headers, timeout=60, **kwargs)


def sse_events(body: str) -> list:
    """The data payloads of an SSE body, [DONE] included as the string."""
    events = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def chat_ids(hf_tok, messages) -> list[int]:
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def assert_serves(client) -> None:
    """The engine still answers after an error."""
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1


CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name the capital of France."},
]


# --- chat and completions ------------------------------------------------------------------


def test_models_and_system_routes(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == MAX_LEN
    assert httpx.get(server.base_url + "/version").json()["version"]
    health = httpx.get(server.base_url + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert httpx.get(server.base_url + "/docs/openapi.json").json()["paths"]["/v1/completions"]


def test_chat_sync_usage_matches_tokenizer(client, hf_tok):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.model == MODEL and len(r.choices) == 1
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert r.usage.prompt_tokens == len(chat_ids(hf_tok, CHAT))
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    if choice.finish_reason == "length":
        assert r.usage.completion_tokens == 8


def test_chat_content_parts_equal_plain_string(client):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital?"}]}]
    plain = [{"role": "user", "content": "What is the capital?"}]
    a = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=6, temperature=0)
    b = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_stream_equals_non_stream_and_include_usage(client):
    full = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == ["length"]
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert {c.id for c in chunks} == {chunks[0].id}


def test_completions_sync_and_token_prompt(client, hf_tok):
    prompt = "The capital of France is"
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(hf_tok.encode(prompt))
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    ids = hf_tok.encode(prompt)
    r2 = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r2.choices[0].text == r.choices[0].text
    echo = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        temperature=0,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert echo.choices[0].text == prompt + r.choices[0].text


def test_completions_prompt_list_and_n(client):
    r = client.completions.create(
        model=MODEL,
        prompt=["Hello world", "The quick brown fox"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.usage.completion_tokens == 16
    assert all(c.finish_reason == "length" for c in r.choices)


def test_chat_n2(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.usage.completion_tokens == 12


def test_completions_stream_n2_with_usage(client):
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="Hello",
            n=2,
            max_tokens=6,
            temperature=1.0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    by_index: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] += ch.text
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"}
    assert chunks[-1].usage.completion_tokens == 12


def test_seed_reproducibility(client):
    def sample(seed):
        return (
            client.completions.create(
                model=MODEL,
                prompt="Once upon a time",
                max_tokens=16,
                temperature=1.0,
                seed=seed,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3, 4)}) > 1


STOP_KWARGS = dict(
    model=MODEL, prompt="Hello world", max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
)


def _stop_case(client) -> tuple[str, str]:
    """A stop string taken from the middle of the greedy output, and the text before it."""
    full = client.completions.create(**STOP_KWARGS).choices[0].text
    assert len(full) >= 12, full
    stop = full[6:9]
    return stop, full[: full.index(stop)]


def test_stop_string_and_finish_reasons(client):
    stop, cut = _stop_case(client)
    r = client.completions.create(**STOP_KWARGS, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == cut


def test_stop_string_when_streaming(client):
    stop, cut = _stop_case(client)
    streamed = list(client.completions.create(**STOP_KWARGS, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_eos_via_logit_bias_finishes_with_stop(client, hf_tok):
    eos = hf_tok.eos_token_id
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=10, temperature=0, logit_bias={str(eos): 100}
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == ""


def test_logprobs_shapes(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)

    c = client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == c.choices[0].text


async def test_async_client_chat_and_stream(aclient):
    r = await aclient.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = await aclient.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == r.choices[0].message.content
    # Several at once are batched and each gets its own answer.
    results = await asyncio.gather(
        *(
            aclient.completions.create(
                model=MODEL,
                prompt=f"Number {i}",
                max_tokens=5,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            for i in range(8)
        )
    )
    assert all(x.usage.completion_tokens == 5 for x in results)


def test_tokenize_detokenize(server, hf_tok):
    r = raw(server, "POST", "/tokenize", json={"model": MODEL, "prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == hf_tok.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_LEN
    r = raw(server, "POST", "/tokenize", json={"messages": CHAT})
    assert r.json()["tokens"] == chat_ids(hf_tok, CHAT)
    d = raw(server, "POST", "/detokenize", json={"tokens": body["tokens"]})
    assert d.json() == {"prompt": "Hello world"}


def test_bench_serve_runs_against_this_server(server):
    from benchmarks import bench_serve

    s = bench_serve.main(
        [
            "--base-url",
            server.base_url,
            "--api-key",
            KEY,
            "--num-prompts",
            "4",
            "--max-concurrency",
            "2",
            "--random-input-len",
            "8",
            "--random-output-len",
            "6",
            "--ignore-eos",
            "--endpoint",
            "/v1/chat/completions",
        ]
    )
    assert s["model"] == MODEL  # found through /v1/models
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 24


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_asks_for_whole_answers(server, endpoint):
    from benchmarks import bench_serve

    s = bench_serve.main(
        ["--base-url", server.base_url, "--api-key", KEY, "--num-prompts", "3",
         "--max-concurrency", "3", "--random-input-len", "8", "--random-output-len", "6",
         "--ignore-eos", "--endpoint", endpoint, "--no-stream"]
    )  # fmt: skip
    assert s["completed"] == 3 and s["failed"] == 0 and s["total_output_tokens"] == 18
    assert s["median_ttft_ms"] == pytest.approx(s["median_e2el_ms"])  # no stream: the latency
    assert math.isnan(s["median_tpot_ms"]) and math.isnan(s["median_itl_ms"])


# --- the error table ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param, fragment",
    [
        (dict(temperature=5), "temperature", "temperature must be in [0, 2]"),
        (dict(n=100), "n", "n must be between 1 and"),
        (dict(top_p=0), "top_p", "top_p"),
        (dict(max_tokens=0), "max_tokens", "max_tokens must be at least 1"),
        (dict(logit_bias={"abc": 1}), "logit_bias", "logit_bias keys must be token ids"),
        (dict(extra_body={"stop_token_ids": [10**6]}), None, "stop_token_ids"),
    ],
)
def test_400_invalid_parameters(client, kwargs, param, fragment):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="Hello", **{"max_tokens": 4, **kwargs})
    err = exc.value.body
    assert exc.value.status_code == 400
    assert exc.value.type == "invalid_request_error"
    assert fragment in err["message"]
    if param:
        assert err["param"] == param
    assert_serves(client)


def test_400_prompt_too_long(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[5] * 500, max_tokens=100)
    msg = exc.value.body["message"]
    assert "maximum context length is 512 tokens" in msg
    assert "your prompt has 500 tokens and max_tokens asks for 100 more" in msg
    assert exc.value.body["param"] == "prompt"
    long_chat = [{"role": "user", "content": "Hello world " * 400}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=long_chat, max_tokens=10)
    assert exc.value.body["param"] == "messages"
    assert "maximum context length is 512 tokens" in exc.value.body["message"]
    assert_serves(client)


def test_400_malformed_bodies(server, client):
    for body in (b"{not json", b'{"model": "tiny"}', b'{"model": "tiny", "prompt": "x", "n": "a"}'):
        r = raw(
            server,
            "POST",
            "/v1/completions",
            content=body,
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400, body
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = raw(
        server,
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = raw(
        server,
        "POST",
        "/v1/completions",
        json={"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert_serves(client)


def test_401_missing_or_wrong_key(server, client):
    bad = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert exc.value.code == "invalid_api_key"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # Auth is checked before the body: a bad key with a bad body is still 401.
    r = httpx.post(server.base_url + "/v1/completions", content=b"{bad")
    assert r.status_code == 401
    assert_serves(client)


def test_404_unknown_model(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-nope", messages=CHAT, max_tokens=2)
    assert exc.value.code == "model_not_found"
    assert exc.value.body["param"] == "model"
    assert "gpt-nope" in exc.value.body["message"]
    assert_serves(client)


def test_413_body_too_large(server, client):
    body = json.dumps({"model": MODEL, "prompt": "x" * 100_000, "max_tokens": 1})
    r = raw(
        server,
        "POST",
        "/v1/completions",
        content=body,
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 413
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "--max-body-size" in r.json()["error"]["message"]
    assert_serves(client)


def test_unknown_route_is_an_openai_error(server):
    r = raw(server, "GET", "/v1/nope")
    assert r.status_code == 404 and "error" in r.json()


# --- disconnects ------------------------------------------------------------------------------


async def _open_and_drop(server, i: int) -> None:
    body = {
        "model": MODEL,
        "prompt": f"Story {i}",
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text":"' in line:
                return  # mid-generation: leaving the block closes the connection


def test_disconnect_storm_frees_everything(server):
    before = server.wait_idle()
    assert before["kv_cache_usage"] == 0.0

    async def storm():
        await asyncio.gather(*(_open_and_drop(server, i) for i in range(50)))

    asyncio.run(storm())
    # A new request is served at once (the client gives up after 5 s) ...
    fast = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=5)
    assert_serves(fast)
    # ... and afterwards no request holds a KV block, a batch slot or a queue place.
    after = server.wait_idle()
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    assert after["kv_cache_usage"] == 0.0 and after["inflight_requests"] == 0
    # The 50 were aborted, not run to their 400 tokens.
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert generated < 50 * 400 // 2


def test_non_streaming_disconnect_aborts(server, client):
    before = server.wait_idle()

    async def go():
        body = {
            "model": MODEL,
            "prompt": "Long story",
            "max_tokens": 480,
            "temperature": 0,
            "ignore_eos": True,
            "n": 8,
        }
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            task = asyncio.create_task(c.post("/v1/completions", json=body, headers=headers))
            while (await c.get("/health", params={"verbose": "true"})).json()["engine"][
                "num_running"
            ] == 0:
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert_serves(client)
    after = server.wait_idle()
    assert after["kv_cache_usage"] == 0.0 and after["num_running"] == 0
    # Cut short: 8 samples of 480 tokens were not all generated.
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 8 * 480
