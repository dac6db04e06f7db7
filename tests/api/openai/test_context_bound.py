"""The floor on a prompt's tokens (api/openai/context_bound.py): never above the true count on real
tokenizers, and a refusal naming the part that does not fit."""

from __future__ import annotations

import msgspec
import pytest

from api.openai.context_bound import (
    chat_floor,
    refuse_chat_that_cannot_fit,
    refuse_text_that_cannot_fit,
)
from api.openai.inputs import render_chat
from api.openai.schemas import ChatCompletionRequest
from api.server.errors import APIError
from engine.tokenizer import Tokenizer


def _request(messages: list[dict], tools: list[dict] | None = None) -> ChatCompletionRequest:
    body = {"model": "m", "messages": messages}
    if tools is not None:
        body["tools"] = tools
    return msgspec.convert(body, ChatCompletionRequest)


def _tool(name: str, description: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": description}}


@pytest.mark.parametrize(
    "contents",
    [
        ["hi"] * 30,
        ["", "", ""],
        ["The capital of France is Paris. " * 40, "ok"],
        ["\n" + " " * 200, "東京 🙂 café naïve" * 20],
    ],
)
def test_the_floor_is_never_above_the_templated_count(tiny_llama_dir, contents):
    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    messages = [{"role": "user", "content": c} for c in contents]
    data = _request(messages)
    floor, tools = chat_floor(data.messages, None, tokenizer.max_token_chars, 10**9)
    assert tools == 0
    assert floor <= len(render_chat(tokenizer, data.messages, True, "messages"))
    text = "".join(contents)
    assert -(-len(text) // tokenizer.max_token_chars) <= len(tokenizer.encode(text))


def test_max_token_chars_is_the_longest_vocabulary_entry(tiny_llama_dir):
    tokenizer = Tokenizer.from_pretrained(tiny_llama_dir)
    assert tokenizer.max_token_chars == max(len(t) for t in tokenizer.hf.get_vocab())
    assert tokenizer.max_token_chars >= len("<|endoftext|>")


def test_the_count_of_messages_alone_refuses_without_reading_them():
    data = _request([{"role": "user", "content": "x"}] * 1000)
    floor, _ = chat_floor(data.messages, None, max_token_chars=10, stop_above=100)
    assert floor == 1000  # the count, no loop over the contents
    with pytest.raises(APIError) as caught:
        refuse_chat_that_cannot_fit(data.messages, None, 4, limit=512, max_token_chars=10)
    assert caught.value.param == "messages"
    assert "at least 1000 tokens" in caught.value.message
    assert "max_tokens asks for 4 more" in caught.value.message


def test_the_loop_stops_once_the_floor_passes_the_context():
    data = _request([{"role": "user", "content": "y" * 100}] * 50)
    floor, _ = chat_floor(data.messages, None, max_token_chars=10, stop_above=95)
    assert floor == 100  # ten messages of ten tokens: past 95, the rest unread


def test_tools_that_cannot_fit_name_tools():
    data = _request(
        [{"role": "user", "content": "hi"}], [_tool(f"f{i}", "d" * 1000) for i in range(20)]
    )
    with pytest.raises(APIError) as caught:
        refuse_chat_that_cannot_fit(data.messages, data.tools, None, 512, 10)
    assert caught.value.param == "tools"
    # Small tools and messages that fit pass, max_tokens counted after them.
    small = _request([{"role": "user", "content": "hi"}], [_tool("f", "d" * 100)])
    refuse_chat_that_cannot_fit(small.messages, small.tools, 400, 512, 10)
    with pytest.raises(APIError):
        refuse_chat_that_cannot_fit(small.messages, small.tools, 510, 512, 10)


def test_a_prompt_is_refused_from_its_length():
    refuse_text_that_cannot_fit("x" * 5000, None, 512, 10)
    with pytest.raises(APIError) as caught:
        refuse_text_that_cannot_fit("x" * 5200, 16, 512, 10)
    assert caught.value.param == "prompt" and "at least 520 tokens" in caught.value.message
