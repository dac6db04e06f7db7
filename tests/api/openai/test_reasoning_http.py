"""--reasoning-parser over HTTP: a real `tessera serve` on loopback (a tiny Llama whose
template opens a think section, tests/conftest.py's REASONING_TEMPLATE) driven by the openai
SDK: the thinking comes back as reasoning_content, the answer as content, streamed the same;
a grammar applies to the answer only, or from the first token where the template closed the
think section (enable_thinking: false)."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow

KEY = "sk-reasoning"
CHOICES = ["yes", "no"]


@pytest.fixture(scope="module")
def end_think(tiny_reasoning_dir) -> str:
    """</think>'s id, as logit_bias keys it."""
    from transformers import AutoTokenizer

    return str(
        AutoTokenizer.from_pretrained(str(tiny_reasoning_dir)).convert_tokens_to_ids("</think>")
    )


@pytest.fixture(scope="module")
def client(start_server, tiny_reasoning_dir):
    server = start_server(
        tiny_reasoning_dir, "--api-key", KEY, "--reasoning-parser", "deepseek_r1",
        "--trust-request-chat-template",
    )  # fmt: skip
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(client, **kw):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Is Paris in France?"}],
        temperature=0,
        **kw,
    )


def test_thinking_that_never_ends_is_all_reasoning(client):
    r = _chat(client, max_tokens=6)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert message.content is None and message.reasoning_content  # the think section, cut off


def test_the_grammar_holds_the_answer_after_the_thinking(client, end_think):
    """logit_bias pushes </think> at every step: it ends the thinking at once, and then the
    grammar (a choice) holds every later token to the answer."""
    body = {"structured_outputs": {"choice": CHOICES}}
    r = _chat(client, max_tokens=12, logit_bias={end_think: 100}, extra_body=body, logprobs=True)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert message.reasoning_content == "" and message.content in CHOICES
    assert r.choices[0].logprobs.content[0].token == "</think>"
    # the template closing the section: no thinking, the grammar from the first token
    closed = {**body, "chat_template_kwargs": {"enable_thinking": False}}
    r = _chat(client, max_tokens=12, logit_bias={end_think: 100}, extra_body=closed)
    message = r.choices[0].message
    assert message.content in CHOICES and getattr(message, "reasoning_content", None) is None


def test_streamed_reasoning_and_content_add_up_to_the_reply(client, end_think):
    body = {"structured_outputs": {"choice": CHOICES}}
    kw = dict(max_tokens=12, logit_bias={end_think: 100}, extra_body=body)
    whole = _chat(client, **kw).choices[0].message
    thinking, content = [], []
    for chunk in _chat(client, stream=True, **kw):
        for choice in chunk.choices:
            thinking.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert "".join(content) == whole.content and "".join(thinking) == whole.reasoning_content
    kw["extra_body"] = {**body, "include_reasoning": False}
    hidden = _chat(client, **kw)
    assert getattr(hidden.choices[0].message, "reasoning_content", None) is None


def test_responses_carry_the_thinking_as_a_reasoning_item(client):
    """/v1/responses on the same server: the think section is a reasoning item (as chat's
    reasoning_content), whole and streamed, and the reasoning tokens are counted."""
    kw = dict(model=client.models.list().data[0].id, temperature=0, store=False)
    chat = _chat(client, max_tokens=6).choices[0].message
    r = client.responses.create(input="Is Paris in France?", max_output_tokens=6, **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["reasoning"]
    assert r.output[0].content[0].text == chat.reasoning_content
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    deltas, final = [], None  # cut off: the stream ends with response.incomplete, as OpenAI's
    for event in client.responses.create(
        input="Is Paris in France?", max_output_tokens=6, stream=True, **kw
    ):
        if event.type == "response.reasoning_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == chat.reasoning_content
    assert final is not None and final.status == "incomplete"
    assert [item.type for item in final.output] == ["reasoning"]


def test_reasoning_effort_is_a_template_variable(client):
    """reasoning_effort reaches the chat template (gpt-oss's sets its reasoning level from
    it): a template that writes it makes a longer prompt; an unknown level is a 400."""
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %} {{ reasoning_effort | default('') }}"
    )
    body = {"chat_template": template}
    plain = _chat(client, max_tokens=1, extra_body=body).usage.prompt_tokens
    high = _chat(client, max_tokens=1, reasoning_effort="high", extra_body=body)
    assert high.usage.prompt_tokens > plain
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, max_tokens=1, reasoning_effort="extreme")
    assert err.value.body["param"] == "reasoning_effort"
