"""Bodies whose text cannot fit the context are refused from their size, before a template or
a tokenizer runs, and a clean client's completions take the same order of time while they
arrive (a real server on loopback; the probe's bodies from issue 38).

"Never templated" is read from the server's own /metrics: tessera:preprocess_steps counts
every chat-template render and tokenization, inline or in a worker process."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time

import httpx
import pytest

from tests.api.keys_http import MODEL, Admin, bearer, start_keys_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    return start_keys_server(start_server, tiny_llama_dir, tmp, f"sqlite+aiosqlite:///{tmp}/t.db")


@pytest.fixture(scope="module")
def auth(server) -> dict[str, str]:
    _, key = Admin(server).create_key("hostile", rpm_limit=100_000, token_budget=10**12)
    return bearer(key)


def _steps(server) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    found = re.findall(r'^tessera:preprocess_steps_total\{step="(\w+)"\} (\S+)$', text, re.M)
    return {step: float(v) for step, v in found}


def many_messages(n: int = 120_000) -> bytes:
    """The probe's first body: n one-word messages (~4 MB, under the body limit)."""
    one = b'{"role":"user","content":"hi"},'
    return (
        b'{"model":"%s","max_tokens":1,"messages":[' % MODEL.encode()
        + one * (n - 1)
        + b'{"role":"user","content":"hi"}]}'
    )


def many_tools(n: int = 200, chars: int = 15_000) -> bytes:
    """The probe's second body: n tools with descriptions of `chars` characters."""
    tools = [
        {
            "type": "function",
            "function": {"name": f"f{i}", "description": "word " * (chars // 5), "parameters": {}},
        }
        for i in range(n)
    ]
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    return json.dumps({**body, "tools": tools}).encode()


def _post(server, auth, path: str, content: bytes) -> httpx.Response:
    headers = {**auth, "content-type": "application/json"}
    return httpx.post(server.base_url + path, content=content, headers=headers, timeout=120)


@pytest.mark.parametrize(
    ("body", "param", "floor"),
    [(many_messages, "messages", 120_000), (many_tools, "tools", 200 * 15_000 // 13)],
    ids=["120k-messages", "200-tools"],
)
def test_a_body_that_cannot_fit_is_refused_before_templating(server, auth, body, param, floor):
    before = _steps(server)
    r = _post(server, auth, "/v1/chat/completions", body())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert "maximum context length is 512 tokens" in error["message"]
    # The floor in the message: every message one token at least, a token at most the
    # tiny vocabulary's longest entry (13 characters: <|endoftext|>).
    stated = int(re.search(r"at least (\d+) tokens", error["message"]).group(1))
    assert 512 < stated <= floor
    after = _steps(server)
    assert after.get("render_chat", 0) == before.get("render_chat", 0), (before, after)
    assert after.get("encode_text", 0) == before.get("encode_text", 0)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server, auth):
    before = _steps(server)
    body = {"model": MODEL, "prompt": "word " * 200_000, "max_tokens": 4}
    r = _post(server, auth, "/v1/completions", json.dumps(body).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert _steps(server).get("encode_text", 0) == before.get("encode_text", 0)


def test_a_body_that_fits_is_still_templated(server, auth):
    """The floor refuses nothing that fits: 20 messages and a tool in 512 tokens."""
    before = _steps(server).get("render_chat", 0)
    messages = [{"role": "user", "content": "hi"}] * 20
    tool = {"type": "function", "function": {"name": "f", "description": "does f"}}
    body = {"model": MODEL, "max_tokens": 2, "messages": messages, "tools": [tool]}
    r = _post(server, auth, "/v1/chat/completions", json.dumps(body).encode())
    assert r.status_code == 200, r.text
    assert _steps(server)["render_chat"] == before + 1


def _clean_latencies(server, auth, n: int) -> list[float]:
    body = {"model": MODEL, "prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
    out = []
    with httpx.Client(base_url=server.base_url, headers=auth, timeout=60) as c:
        for _ in range(n):
            t0 = time.perf_counter()
            assert c.post("/v1/completions", json=body).status_code == 200
            out.append(time.perf_counter() - t0)
    return out


def test_a_clean_client_keeps_its_pace_while_the_probe_bodies_arrive(server, auth):
    bodies = [many_messages(), many_tools()]
    alone = _clean_latencies(server, auth, 10)
    stop = threading.Event()
    refused = []

    def hostile() -> None:
        with httpx.Client(base_url=server.base_url, headers=auth, timeout=120) as c:
            while not stop.is_set() and len(refused) < 40:  # bounded in count and time
                body = bodies[len(refused) % 2]
                r = c.post(
                    "/v1/chat/completions",
                    content=body,
                    headers={"content-type": "application/json"},
                )
                refused.append(r.status_code)

    thread = threading.Thread(target=hostile)
    thread.start()
    try:
        while not refused:  # the probe is going
            time.sleep(0.01)
        during = _clean_latencies(server, auth, 10)
    finally:
        stop.set()
        thread.join(timeout=120)
    assert set(refused) == {400}
    # Same order of time: the median within a few times the median alone (before the
    # floor, the probe's bodies took seconds each and so did the completions beside them).
    assert statistics.median(during) < 4 * statistics.median(alone) + 0.05, (alone, during)
