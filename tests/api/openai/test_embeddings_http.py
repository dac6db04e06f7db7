"""/v1/embeddings over HTTP through the official `openai` client: a real `tessera serve` of
a tiny Qwen3Model (--runner auto picks pooling) with keys on a real SQLite file; its vectors
against HF transformers' last hidden state, float and base64 encodings, batches of text and
token ids, Matryoshka dimensions, truncate_prompt_tokens, the usage row, and the 400s (bad
dimensions, empty and too long inputs, generation on the pooling runner). The generating
runner's 400 for /v1/embeddings is checked in test_generation_config_http.py (a server of
a generative model already running there)."""

from __future__ import annotations

import sqlite3

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from tests.api.keys_http import MODEL, Admin, bearer, start_keys_server

pytestmark = pytest.mark.slow
MAX_LEN = 128


@pytest.fixture(scope="module")
def env(start_server, tiny_embedding_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embeddings")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    server = start_keys_server(
        start_server,
        tiny_embedding_dir,
        tmp,
        url,
        "--max-model-len",
        str(MAX_LEN),
        "--max-num-batched-tokens",
        "16",  # inputs longer than 16 tokens run in chunks
    )
    admin = Admin(server)
    key_id, key = admin.create_key("embedder")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    return server, admin, key_id, key, client, tmp / "tessera.db"


def hf_last_token(folder, ids: list[int], dims: int | None = None) -> np.ndarray:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        vec = model(torch.tensor([ids])).last_hidden_state[0, -1]
    return F.normalize(vec[:dims] if dims else vec, dim=-1).numpy()


def tokenize(server, key: str, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json={"prompt": text}, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_embeddings_match_hf_in_float_and_base64(env, tiny_embedding_dir):
    server, admin, key_id, key, client, db = env
    texts = ["Hello world", "The capital of France is Paris. Paris is a city on the Seine."]
    ids = [tokenize(server, key, t) for t in texts]
    assert len(ids[1]) > 16  # chunked prefill
    floats = client.embeddings.create(model=MODEL, input=texts, user="alice")
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for d, toks in zip(floats.data, ids, strict=True):
        np.testing.assert_allclose(
            d.embedding, hf_last_token(tiny_embedding_dir, toks), atol=2e-5, rtol=1e-4
        )
    # the SDK asks for base64 by default and decodes it (little-endian float32)
    b64 = client.embeddings.create(model=MODEL, input=texts[1])
    np.testing.assert_allclose(b64.data[0].embedding, floats.data[1].embedding, atol=2e-6)
    raw = httpx.post(
        server.base_url + "/v1/embeddings",
        json={"model": MODEL, "input": texts[1], "encoding_format": "base64"},
        headers=bearer(key),
    ).json()
    assert isinstance(raw["data"][0]["embedding"], str)
    # token ids, one list and a batch of lists; the same vectors
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, floats.data[0].embedding, atol=2e-6)
    batch = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    np.testing.assert_allclose(batch.data[1].embedding, floats.data[1].embedding, atol=2e-6)
    # one usage row per request: prompt tokens, no completion tokens; `user` recorded
    usage = admin.usage(key_id)
    assert usage["requests"] == 5 and usage["completion_tokens"] == 0
    n0, n1 = map(len, ids)
    assert usage["prompt_tokens"] == (n0 + n1) + n1 + n1 + n0 + (n0 + n1)
    with sqlite3.connect(db) as conn:
        users = conn.execute(
            "SELECT end_user, prompt_tokens, completion_tokens, status_code FROM usage_records"
            " WHERE end_user IS NOT NULL"
        ).fetchall()
    assert users == [("alice", sum(map(len, ids)), 0, 200)]
    assert server.wait_idle()["kv_cache_usage"] == 0.0


def test_matryoshka_dimensions_and_truncation(env, tiny_embedding_dir):
    server, _, _, key, client, _ = env
    ids = tokenize(server, key, "Tessera serves language models with a paged cache.")
    short = client.embeddings.create(
        model=MODEL, input=[ids], dimensions=16, encoding_format="float"
    )
    vec = short.data[0].embedding
    assert len(vec) == 16
    np.testing.assert_allclose(
        vec, hf_last_token(tiny_embedding_dir, ids, 16), atol=2e-5, rtol=1e-4
    )
    with pytest.raises(openai.BadRequestError) as e:  # not one of 16, 32, 64
        client.embeddings.create(model=MODEL, input="Hello", dimensions=20)
    assert e.value.body["param"] == "dimensions" and "16, 32, 64" in e.value.body["message"]
    # too long: a 400, unless truncate_prompt_tokens keeps the last tokens
    long_ids = (ids * 20)[: MAX_LEN + 10]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input=[long_ids])
    assert e.value.body["param"] == "input" and str(MAX_LEN) in e.value.body["message"]
    kept = client.embeddings.create(
        model=MODEL, input=[long_ids], encoding_format="float",
        extra_body={"truncate_prompt_tokens": 20},
    )  # fmt: skip
    np.testing.assert_allclose(
        kept.data[0].embedding, hf_last_token(tiny_embedding_dir, long_ids[-20:]), atol=2e-5, rtol=1e-4
    )  # fmt: skip
    assert kept.usage.prompt_tokens == 20


def test_bad_inputs_and_generation_are_400s(env):
    server, _, _, key, client, _ = env
    for bad in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(model=MODEL, input=bad)
        assert e.value.body["param"] == "input", bad
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model=MODEL, input="Hi", extra_body={"normalize": False})
    assert e.value.body["param"] == "normalize"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert "--runner pooling" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert "--runner pooling" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="another-model", input="Hi")
    assert httpx.post(server.base_url + "/v1/embeddings", json={"model": MODEL, "input": "x"}).status_code == 401  # fmt: skip
    assert server.wait_idle()["kv_cache_usage"] == 0.0
