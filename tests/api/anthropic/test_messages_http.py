"""The Anthropic Messages API end to end: a real `tessera serve` in keys mode (SQLite) of the
tiny model trained to call tools (tests/api/openai/tools/tool_model.py: Hermes template),
driven by the official `anthropic` SDK with a database key as `x-api-key`, and raw SSE where
the exact event lines matter. Replies, stop reasons, streaming, tool use round trips,
count_tokens, usage rows and errors in Anthropic's shape."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import Tokenizer
from tests.api.keys_http import MODEL, Admin, start_keys_server
from tests.api.openai.tools.tool_model import PARIS, TOOLS
from tests.api.usage.test_usage_http import ledger

pytestmark = pytest.mark.slow

# The tool model's tools, as Anthropic declares them.
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
HELLO = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0}  # this SDK's create() has no temperature argument any more
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def env(start_server, tool_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("anthropic")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    server = start_keys_server(start_server, tool_model_dir, tmp, url)
    admin = Admin(server)
    key_id, key = admin.create_key("anthropic", rpm_limit=10**6, token_budget=10**12)
    return server, admin, key_id, key, url


@pytest.fixture(scope="module")
def client(env):
    server, _, _, key, _ = env
    return anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def create(client, messages, **kwargs):
    kwargs.setdefault("tools", ANTHROPIC_TOOLS)
    kwargs.setdefault("max_tokens", 120)
    return client.messages.create(model=MODEL, messages=messages, extra_body=GREEDY, **kwargs)


def raw_events(server, key: str, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of a streamed /v1/messages, checking each `event:` line names the
    type of the `data:` line after it."""
    body = {"model": MODEL, "max_tokens": 120, "temperature": 0, "stream": True, **body}
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    url = server.base_url + "/v1/messages"
    events, name = [], None
    with httpx.stream("POST", url, json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: ") :])
                assert data["type"] == name, (name, data)
                events.append((name, data))
                name = None
    return events


# --- replies and stop reasons ------------------------------------------------------------------


def test_text_reply_is_a_message(client):
    r = create(client, HELLO)
    assert r.type == "message" and r.role == "assistant" and r.model == MODEL
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == "Hello! How can I help?"
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0


def test_stop_sequences_end_with_stop_sequence(client):
    r = create(client, HELLO, stop_sequences=["zzz", "How"])
    assert r.content[0].text == "Hello! "
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "How"


def test_max_tokens_ends_with_max_tokens(client):
    r = create(client, HELLO, max_tokens=2)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_system_prompt_reaches_the_template(client, env, tool_model_dir):
    """The prompt is the chat template's rendering with the system message (and the tools)."""
    system = "You are terse."
    r = create(client, HELLO, system=[{"type": "text", "text": system}], max_tokens=1)
    tok = Tokenizer.from_pretrained(tool_model_dir)
    messages = [{"role": "system", "content": system}, *HELLO]
    assert r.usage.input_tokens == len(tok.apply_chat_template(messages, tools=TOOLS))
    plain = create(client, HELLO, system=system, max_tokens=1)
    assert plain.usage.input_tokens == r.usage.input_tokens


def test_count_tokens_is_the_chat_templates_count(client, env, tool_model_dir):
    server, _, _, key, _ = env
    tok = Tokenizer.from_pretrained(tool_model_dir)
    counted = client.messages.count_tokens(model=MODEL, messages=HELLO, system="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}, *HELLO]
    assert counted.input_tokens == len(tok.apply_chat_template(messages))
    r = httpx.post(
        server.base_url + "/tokenize",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert r.json()["count"] == counted.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=HELLO, tools=ANTHROPIC_TOOLS)
    assert with_tools.input_tokens == len(tok.apply_chat_template(HELLO, tools=TOOLS))
    assert with_tools.input_tokens == create(client, HELLO, max_tokens=1).usage.input_tokens


# --- streaming ---------------------------------------------------------------------------------


def test_stream_events_as_anthropic_sends_them(client, env):
    server, _, _, key, _ = env
    whole = create(client, HELLO)
    events = raw_events(server, key, {"messages": HELLO, "tools": ANTHROPIC_TOOLS})
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"
    assert set(names[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert (
        start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    )
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == whole.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == whole.usage.output_tokens


def test_sdk_stream_matches_the_whole_reply(client):
    whole = create(client, HELLO, stop_sequences=["help"])
    with client.messages.stream(
        model=MODEL,
        messages=HELLO,
        tools=ANTHROPIC_TOOLS,
        max_tokens=120,
        extra_body=GREEDY,
        stop_sequences=["help"],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == "Hello! How can I "
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "help"
    assert final.usage.output_tokens == whole.usage.output_tokens
    kinds = [e.type for e in create(client, HELLO, stream=True, max_tokens=2)]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


# --- tool use ----------------------------------------------------------------------------------


def test_tool_use_round_trip(client):
    first = create(client, WEATHER)
    assert first.stop_reason == "tool_use"
    text, call = first.content
    assert text.type == "text" and text.text == "Let me check.\n"
    assert call.type == "tool_use" and call.id.startswith("toolu_") and len(call.id) > 10
    assert call.name == "get_weather" and call.input == PARIS
    history = [
        *WEATHER,
        {"role": "assistant", "content": [{"type": "tool_use", **call.model_dump()}]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temp": 21}'}],
        },
    ]
    # The learned reply comes from the round trip as the chat template renders it.
    answer = create(client, history)
    assert answer.stop_reason == "end_turn"
    assert answer.content[0].text == "It is 21 C in Paris."


def test_streamed_tool_use_matches_the_whole_one(client, env):
    server, _, _, key, _ = env
    whole = create(client, WEATHER)
    events = raw_events(server, key, {"messages": WEATHER, "tools": ANTHROPIC_TOOLS})
    starts = [d for n, d in events if n == "content_block_start"]
    assert [s["content_block"]["type"] for s in starts] == ["text", "tool_use"]
    block = starts[1]["content_block"]
    assert block["name"] == "get_weather" and block["input"] == {}
    assert block["id"].startswith("toolu_")
    fragments = [
        d["delta"]["partial_json"]
        for n, d in events
        if n == "content_block_delta" and d["delta"]["type"] == "input_json_delta"
    ]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == whole.content[1].input
    assert all(
        d["index"] == 1
        for n, d in events
        if n == "content_block_delta" and "partial_json" in d["delta"]
    )
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(
        model=MODEL, messages=WEATHER, tools=ANTHROPIC_TOOLS, max_tokens=120, extra_body=GREEDY
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == PARIS and final.stop_reason == "tool_use"


def test_tool_choice_forces_a_call_through_the_grammar(client):
    named = create(client, HELLO, tool_choice={"type": "tool", "name": "get_time"})
    assert named.stop_reason == "tool_use"
    (call,) = named.content
    assert call.name == "get_time" and call.input["zone"] in ("UTC", "CET")
    forced = create(client, HELLO, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert forced.stop_reason == "tool_use"
    assert [b.type for b in forced.content] == ["tool_use"]
    none = create(client, WEATHER, tool_choice={"type": "none"}, max_tokens=20)
    assert all(b.type == "text" for b in none.content) and none.stop_reason != "tool_use"


# --- auth, errors, usage -----------------------------------------------------------------------


def _error(exc) -> dict:
    body = exc.value.response.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    return body["error"]


def test_auth_by_x_api_key_or_bearer(env):
    server, _, _, key, _ = env
    for bad in ("tsr-" + "x" * 43, "sk-nope"):
        c = anthropic.Anthropic(base_url=server.base_url, api_key=bad, max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as exc:
            c.messages.create(model=MODEL, messages=HELLO, max_tokens=1)
        assert exc.value.status_code == 401
        assert _error(exc)["type"] == "authentication_error"
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL}, timeout=30)
    assert r.status_code == 401
    assert r.json()["error"] == {
        "type": "authentication_error",
        "message": "Missing API key. Send it as an `x-api-key` header (or `Authorization: "
        "Bearer <key>`).",
    }
    bearer = anthropic.Anthropic(base_url=server.base_url, auth_token=key, max_retries=0)
    assert bearer.messages.create(model=MODEL, messages=HELLO, max_tokens=1).usage.output_tokens
    # The OpenAI routes keep their envelope.
    r = httpx.post(server.base_url + "/v1/chat/completions", json={}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_errors_in_anthropic_shape(client, env):
    server, admin, _, key, _ = env
    with pytest.raises(anthropic.NotFoundError) as exc:
        client.messages.create(model="nope", messages=HELLO, max_tokens=1)
    assert _error(exc)["type"] == "not_found_error"
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}}
    with pytest.raises(anthropic.BadRequestError) as exc:
        create(client, [{"role": "user", "content": [image]}])
    error = _error(exc)
    assert error["type"] == "invalid_request_error"
    assert "image content blocks are not supported" in error["message"]
    assert "messages[0].content[0]" in error["message"]
    headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
    url = server.base_url + "/v1/messages"
    for body, words in [
        ({"model": MODEL, "messages": HELLO}, "max_tokens"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 1, "n": 2}, "unknown field `n`"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 1, "temperature": 1.5}, "temperature"),
        ({"model": MODEL, "messages": [], "max_tokens": 1}, "at least one message"),
        ({"model": MODEL, "messages": HELLO, "max_tokens": 600}, "maximum context length"),
        (
            {
                "model": MODEL,
                "messages": [*HELLO, {"role": "assistant", "content": "Hi"}],
                "max_tokens": 1,
            },
            "prefill",
        ),
        (
            {
                "model": MODEL,
                "messages": HELLO,
                "max_tokens": 1,
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "thinking",
        ),
    ]:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
        assert words in r.json()["error"]["message"], (words, r.text)
    r = httpx.post(url, content=b"{}", headers={**headers, "content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["type"] == "invalid_request_error"

    _, other = admin.create_key("other-model", allowed_models=["other"])
    c = anthropic.Anthropic(base_url=server.base_url, api_key=other, max_retries=0)
    with pytest.raises(anthropic.PermissionDeniedError) as exc:
        c.messages.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert _error(exc)["type"] == "permission_error"

    _, slow = admin.create_key("one-a-minute", rpm_limit=1)
    c = anthropic.Anthropic(base_url=server.base_url, api_key=slow, max_retries=0)
    c.messages.create(model=MODEL, messages=HELLO, max_tokens=1)
    with pytest.raises(anthropic.RateLimitError) as exc:
        c.messages.create(model=MODEL, messages=HELLO, max_tokens=1)
    assert _error(exc)["type"] == "rate_limit_error"
    assert int(exc.value.response.headers["retry-after"]) >= 1


def test_usage_rows_for_answers_streams_and_refusals(env):
    server, admin, _, _, url = env
    key_id, key = admin.create_key("ledger")
    c = anthropic.Anthropic(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)
    whole = c.messages.create(
        model=MODEL, messages=HELLO, max_tokens=5, metadata={"user_id": "end-user-7"}
    )
    with c.messages.stream(model=MODEL, messages=HELLO, max_tokens=4) as stream:
        streamed = stream.get_final_message()
    with pytest.raises(anthropic.NotFoundError):
        c.messages.create(model="nope", messages=HELLO, max_tokens=1)
    deadline = time.monotonic() + 20
    while True:
        rows = [r for r in ledger(url).values() if r.key_id == key_id]
        if len(rows) >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    by_id = {r.request_id: r for r in rows}
    assert len(rows) == 3, [(r.request_id, r.status_code) for r in rows]
    for message in (whole, streamed):
        row = by_id[message.id]
        assert row.status_code == 200 and row.model == MODEL
        assert (row.prompt_tokens, row.completion_tokens) == (
            message.usage.input_tokens,
            message.usage.output_tokens,
        )
    assert by_id[whole.id].end_user == "end-user-7"
    (refused,) = [r for r in rows if r.request_id not in (whole.id, streamed.id)]
    assert refused.status_code == 404 and refused.completion_tokens == 0
    assert admin.usage(key_id)["requests"] == 3


def _length_finishes(server) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "vllm:request_success_total" and s.labels == {
                "model_name": MODEL,
                "finished_reason": "length",
            }:
                return s.value
    return 0.0


def test_messages_count_in_the_engine_metrics(client, env):
    server = env[0]
    before = _length_finishes(server)
    create(client, HELLO, max_tokens=2)
    with client.messages.stream(model=MODEL, messages=HELLO, max_tokens=2) as stream:
        stream.get_final_message()
    assert _length_finishes(server) == before + 2


def test_the_keys_deadline_holds(env):
    """A key's max_request_seconds bounds /v1/messages as it bounds chat: a deadline already
    past when the engine starts the request is a 504, in Anthropic's body."""
    server, admin, _, _, _ = env
    _, key = admin.create_key("hasty", max_request_seconds=0.001)
    headers = {"x-api-key": key}
    for stream in (False, True):
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 50, "stream": stream}
        r = httpx.post(server.base_url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert r.status_code == 504, r.text
        assert r.json() == {
            "type": "error",
            "error": {"type": "api_error", "message": r.json()["error"]["message"]},
        }
        assert "time limit" in r.json()["error"]["message"]
