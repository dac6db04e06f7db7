"""--generation-config over HTTP: a real server fills what a request leaves unset from the
model's generation_config.json; a request's own chat template needs the server's flag."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.slow


def test_the_server_fills_unset_fields_from_the_model(start_server, genconf_dir):
    server = start_server(genconf_dir, "--api-key", "k", "--served-model-name", "m")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0)
    messages = [{"role": "user", "content": "Paris is"}]
    unset = client.chat.completions.create(model="m", messages=messages)
    given = client.chat.completions.create(
        model="m", messages=messages, temperature=0.0, max_tokens=5, extra_body={"top_k": 5}
    )
    assert unset.usage.completion_tokens == 5  # max_new_tokens, not the rest of the context
    assert unset.choices[0].message.content == given.choices[0].message.content
    # a request's own template only with --trust-request-chat-template
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=messages, extra_body={"chat_template": "{{ 'x' }}"}
        )
    assert e.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in e.value.body["message"]
    # the generate runner does not embed (tests/api/openai/test_embeddings_http.py)
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="m", input="Hello")
    assert "--runner pooling" in e.value.body["message"]


def test_cache_salt_keeps_prefix_cache_blocks_apart(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, "--api-key", "k", "--served-model-name", "m")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="k", max_retries=0)
    prompt = "The capital of France is Paris. " * 8  # several full KV blocks

    def cached(salt):
        r = client.completions.create(
            model="m", prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("team-a") == 0
    assert cached("team-a") > 0  # the same salt: the blocks are found
    assert cached("team-b") == 0  # another salt: nothing shared
