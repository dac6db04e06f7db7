"""Authentication over HTTP against real `tessera serve` processes in keys mode, on a real
SQLite file and on a fresh Postgres database: the first start's printed key works with the
OpenAI SDK, the admin REST life cycle of a key, every 401 case, 403 for a model the key may
not use, and a database outage that is 503, never 401.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import httpx
import openai
import pytest

from tests.api.conftest import REPO, ServerProcess
from tests.api.keys_http import (
    BACKENDS,
    MODEL,
    Admin,
    bearer,
    complete,
    fresh_database,
    pg_run,
    start_keys_server,
)

pytestmark = pytest.mark.slow

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256"]


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"auth-{request.param}")
    with fresh_database(request.param, tmp) as url:
        yield start_keys_server(start_server, tiny_llama_dir, tmp, url)


def test_first_start_prints_a_key_that_works_with_the_sdk(tiny_llama_dir, tmp_path):
    """`make serve` on a fresh machine: no flags but the model. The banner's key works with the
    OpenAI SDK; the admin token is kept (0600) so a restart neither prints nor changes it."""
    env = {"TESSERA_DATA_DIR": str(tmp_path / "data")}
    first = ServerProcess([str(tiny_llama_dir), *COMMON], tmp_path / "first.log", env)
    try:
        first.wait_healthy()
        log = first.log(tail=None)
        key = re.search(r"API key: +(tsr-\S+)", log).group(1)
        admin_token = re.search(r"Admin token: +(tsa-\S+)", log).group(1)
        client = sdk(first, key)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert r.usage.completion_tokens >= 1
        token_file = tmp_path / "data" / "admin_token"
        assert token_file.read_text().strip() == admin_token
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert Admin(first, admin_token).request("GET", "/keys").status_code == 200
    finally:
        assert first.stop() == 0
    # The plaintext key is nowhere in the database files.
    for path in (tmp_path / "data").glob("tessera.db*"):
        assert key.encode() not in path.read_bytes()

    again = ServerProcess([str(tiny_llama_dir), *COMMON], tmp_path / "again.log", env)
    try:
        again.wait_healthy()
        log = again.log(tail=None)
        assert "API key:" not in log and "Admin token:" not in log
        assert Admin(again, admin_token).request("GET", "/keys").status_code == 200
        assert sdk(again, key).models.list().data[0].id == model
    finally:
        again.stop()


def test_admin_rest_key_life_cycle(server):
    admin = Admin(server)
    key_id, key = admin.create_key("life-cycle", metadata={"team": "a"})
    assert key.startswith("tsr-") and len(key) >= 4 + 43
    listed = admin.request("GET", "/keys").json()["data"]
    assert any(k["id"] == key_id for k in listed)
    assert key not in admin.request("GET", "/keys").text  # never a secret after creation
    client = sdk(server, key)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1

    # Rotate: the new secret works, the old one keeps working through its grace period.
    r = admin.request("POST", f"/keys/{key_id}/rotate", json={"grace_seconds": 60})
    assert r.status_code == 200
    rotated = r.json()["key"]
    for secret in (rotated, key):
        assert sdk(server, secret).models.list().data[0].id == MODEL

    admin.revoke(key_id)
    for secret in (rotated, key):
        with pytest.raises(openai.AuthenticationError) as err:
            sdk(server, secret).completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    # An API key is not an admin token.
    assert Admin(server, rotated).request("GET", "/keys").status_code == 401


@pytest.mark.parametrize(
    "authorization",
    [
        None,
        "",
        "Bearer",
        "Basic dXNlcjpwYXNz",
        "Bearer a b",
        "Bearer tsr-" + "x" * 43,  # well-formed, unknown
        "Bearer sk-not-a-tessera-key",
        "Bearer tsr-\u00e9\u00e9\u00e9".encode(),  # not ASCII (UTF-8 bytes on the wire)
        "Bearer tsr-" + "A" * 1100,  # longer than any key
        "Bearer " + "A" * 8000,  # oversized
    ],
)
def test_401_for_missing_unknown_malformed_and_oversized(server, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
    ):
        r = httpx.request(method, server.base_url + path, headers=headers, content=b"{bad")
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_401_for_revoked_and_expired_keys(server):
    admin = Admin(server)
    revoked_id, revoked = admin.create_key()
    assert complete(server, revoked).status_code == 200
    admin.revoke(revoked_id)
    r = complete(server, revoked)
    assert r.status_code == 401 and "revoked" in r.json()["error"]["message"]

    soon = datetime.now(UTC) + timedelta(seconds=2)
    _, expiring = admin.create_key(expires_at=soon.isoformat())
    assert complete(server, expiring).status_code == 200
    time.sleep(max(0.0, (soon - datetime.now(UTC)).total_seconds()) + 0.1)
    r = complete(server, expiring)  # expiry is checked on every request, cache or not
    assert r.status_code == 401 and "expired" in r.json()["error"]["message"]


def test_403_for_a_model_the_key_may_not_use(server):
    admin = Admin(server)
    _, key = admin.create_key(allowed_models=["another-model"])
    r = complete(server, key)
    assert r.status_code == 403
    assert r.json()["error"]["type"] == "permission_denied"
    chat = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        headers=bearer(key),
        timeout=30,
    )
    assert chat.status_code == 403
    r = httpx.post(
        server.base_url + "/tokenize",
        json={"model": MODEL, "prompt": "hi"},
        headers=bearer(key),
        timeout=30,
    )
    assert r.status_code == 403
    # The model list shows only what the key may use.
    r = httpx.get(server.base_url + "/v1/models", headers=bearer(key), timeout=30)
    assert r.status_code == 200 and r.json()["data"] == []
    _, allowed = admin.create_key(allowed_models=[MODEL])
    assert complete(server, allowed).status_code == 200


@pytest.mark.postgres
def test_database_outage_is_503_not_401(start_server, tiny_llama_dir, tmp_path):
    with fresh_database("postgres", tmp_path) as url:
        server = start_keys_server(start_server, tiny_llama_dir, tmp_path, url)
        admin = Admin(server)
        _, limited = admin.create_key(rpm_limit=1000)
        assert complete(server, limited).status_code == 200
        pg_run(f'DROP DATABASE "{url.rsplit("/", 1)[1]}" WITH (FORCE)')

        # An uncached key must be looked up: the lookup fails, which is not a bad key.
        r = complete(server, "tsr-" + "Q" * 43)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "service_unavailable" and r.headers["retry-after"]
        # A cached key still authenticates, but its quota cannot be checked.
        r = complete(server, limited)
        assert r.status_code == 503, r.text
        assert admin.request("GET", "/keys").status_code == 503
        # What needs no database keeps working.
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


@pytest.mark.postgres
def test_serve_refuses_an_unmigrated_postgres(tiny_llama_dir, tmp_path):
    with fresh_database("postgres", tmp_path) as url:
        proc = subprocess.run(
            [sys.executable, "-m", "api.cli", "serve", str(tiny_llama_dir), "--port", "0"]
            + ["--database-url", url, "--data-dir", str(tmp_path)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert proc.returncode == 1
    assert "tessera db upgrade" in proc.stderr, proc.stderr
