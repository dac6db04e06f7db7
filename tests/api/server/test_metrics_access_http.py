"""Who can read /metrics and what it tells them, and the lockout after wrong admin tokens, on
real `tessera serve` processes on loopback (keys mode, SQLite):

- by default /metrics names no key and no tenant (one unlabelled series for all keys);
- --metrics-key-label name / --metrics-tenant-label id opt in to the labels;
- --metrics-token: 401 in the OpenAI envelope without it or with a wrong one, 200 with it;
- the admin REST API and /metrics share the console's lockout: N wrong tokens, then 429
  with Retry-After even for the right one until the window passes; logged once, counted;
  a right metrics token does not reset the count, the admin token does;
- the admin token presented as an API key has a lockout of its own on /v1, which never
  holds back database keys;
- a short --admin-token is warned about at start-up, a long one is not."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from tests.api.keys_http import MODEL, Admin, bearer, complete, start_keys_server

pytestmark = pytest.mark.slow

SHORT_ADMIN = "short-admin-tok"  # 15 characters: warned about, not refused
METRICS_TOKEN = "tmt-" + "m" * 40
MAX_FAILURES = 3
WINDOW_S = 3.0
WARNING = "--admin-token is only"


def metrics(server, token: str | None = None) -> httpx.Response:
    headers = bearer(token) if token is not None else {}
    return httpx.get(server.base_url + "/metrics", headers=headers, timeout=30)


def sample(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert m, f"{name}{{{labels}}} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def default_server(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-default")
    return start_keys_server(start_server, tiny_llama_dir, tmp, f"sqlite+aiosqlite:///{tmp}/t.db")


@pytest.fixture(scope="module")
def guarded_server(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("metrics-guarded")
    return start_server(
        tiny_llama_dir,
        *("--served-model-name", MODEL, "--data-dir", str(tmp)),
        *("--database-url", f"sqlite+aiosqlite:///{tmp}/t.db", "--admin-token", SHORT_ADMIN),
        *("--metrics-token", METRICS_TOKEN),
        *("--metrics-key-label", "name", "--metrics-tenant-label", "id"),
        *("--login-max-failures", str(MAX_FAILURES), "--login-failure-window", str(WINDOW_S)),
    )


def test_by_default_metrics_name_no_key_and_no_tenant(default_server):
    server = default_server
    key_id, key = Admin(server).create_key("alice-at-example")
    assert complete(server, key).status_code == 200
    server.wait_idle()
    r = metrics(server)  # open by default
    assert r.status_code == 200
    text = r.text
    assert "key_name=" not in text and "key_id=" not in text and "tenant=" not in text
    assert "alice-at-example" not in text and key_id not in text
    assert "_by_tenant" not in text
    # The usage is still there, for all keys together.
    assert re.search(r"^tessera:requests_total \d", text, re.M)
    assert sample(text, "tessera:tokens_total", 'kind="generation"') > 0
    # A 35-character admin token: no warning at start-up.
    assert WARNING not in server.log(tail=None)


def test_a_short_admin_token_is_warned_about_at_start_up(guarded_server):
    log = guarded_server.log(tail=None)
    line = next(line for line in log.splitlines() if WARNING in line)
    assert "WARNING" in line and f"only {len(SHORT_ADMIN)} characters" in line
    assert "secrets.token_urlsafe(32)" in line
    assert SHORT_ADMIN not in log and METRICS_TOKEN not in log  # never the secrets


def test_metrics_token_and_opt_in_labels(guarded_server):
    server = guarded_server
    key_id, key = Admin(server, SHORT_ADMIN).create_key("team-a")
    assert complete(server, key).status_code == 200
    server.wait_idle()
    # Two wrong tokens (under --login-max-failures 3): the admin token is not the metrics one.
    for token in (None, "wrong-token", SHORT_ADMIN):
        r = metrics(server, token)
        assert r.status_code == 401, (token, r.text)
        error = r.json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert "tessera:" not in r.text
    r = metrics(server, METRICS_TOKEN)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert sample(text, "tessera:requests_total", 'key_name="team-a"') == 1
    assert sample(text, "tessera:tokens_total", 'key_name="team-a",kind="generation"') > 0
    labels = f'model_name="{MODEL}",tenant="{key_id}"'
    assert sample(text, "tessera:generation_tokens_by_tenant_total", labels) > 0
    # The metrics token is a lesser secret: it does not reset the count of wrong ones, so
    # this is the third, and the client is locked out of /metrics and the admin API alike.
    assert metrics(server, "wrong-again").status_code == 401
    locked_at = time.monotonic()  # the lockout began before this answer came back
    r = metrics(server, METRICS_TOKEN)
    assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_failed_attempts"
    assert "retry-after" in r.headers
    keys = server.base_url + "/admin/v1/keys"
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 429
    time.sleep(max(0.0, WINDOW_S + 0.3 - (time.monotonic() - locked_at)))
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200


def test_wrong_admin_tokens_lock_the_admin_api_out(guarded_server):
    server = guarded_server
    keys = server.base_url + "/admin/v1/keys"
    before = metrics(server, METRICS_TOKEN).text
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    for _ in range(MAX_FAILURES - 1):  # the admin token resets the count
        assert httpx.get(keys, headers=bearer("nope"), timeout=30).status_code == 401
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    for _ in range(MAX_FAILURES):
        r = httpx.get(keys, headers=bearer("tsa-" + "x" * 43), timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    locked_at = time.monotonic()
    r = httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30)  # right, but locked out
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert r.json()["error"]["code"] == "too_many_failed_attempts"
    assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
    # The lockout is the client's, whatever it tries: the metrics token is refused too.
    assert metrics(server, METRICS_TOKEN).status_code == 429
    time.sleep(max(0.0, WINDOW_S + 0.3 - (time.monotonic() - locked_at)))
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    after = metrics(server, METRICS_TOKEN).text
    failures = 2 * MAX_FAILURES - 1
    for name, delta in (
        ("tessera:login_failures_total", failures),
        ("tessera:login_lockouts_total", 1),
    ):
        change = sample(after, name, 'surface="admin_api"') - sample(
            before, name, 'surface="admin_api"'
        )
        assert change == delta, name
    log = server.log(tail=None).splitlines()
    lockouts = [line for line in log if "Locked out" in line and "(admin_api)" in line]
    assert len(lockouts) == 1 and "127.0.0.1" in lockouts[0] and "WARNING" in lockouts[0]
    assert f"{MAX_FAILURES} failed" in lockouts[0] and f"{WINDOW_S:.0f} s" in lockouts[0]


def test_the_admin_token_as_an_api_key_has_a_lockout_of_its_own(guarded_server):
    server = guarded_server
    _, key = Admin(server, SHORT_ADMIN).create_key("api-user")
    models = server.base_url + "/v1/models"
    before = metrics(server, METRICS_TOKEN).text
    assert httpx.get(models, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    for _ in range(MAX_FAILURES):  # not shaped like a database key: guesses
        r = httpx.get(models, headers=bearer("not-a-key"), timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    # The lockout began at the last guess, before its answer came back: a wait measured from
    # before the guesses was short by however long they took (on a loaded host, enough).
    locked_at = time.monotonic()
    for _ in range(MAX_FAILURES):  # shaped like a key: 256 random bits, not counted
        assert httpx.get(models, headers=bearer("tsr-" + "x" * 43), timeout=30).status_code == 401
    r = httpx.get(models, headers=bearer(SHORT_ADMIN), timeout=30)
    assert r.status_code == 401, r.text  # the right admin token is not even compared
    assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(models, headers=bearer(key), timeout=30).status_code == 200  # keys work
    keys = server.base_url + "/admin/v1/keys"  # the console / admin API lockout is another
    assert httpx.get(keys, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    time.sleep(max(0.0, WINDOW_S + 0.3 - (time.monotonic() - locked_at)))
    assert httpx.get(models, headers=bearer(SHORT_ADMIN), timeout=30).status_code == 200
    after = metrics(server, METRICS_TOKEN).text
    change = sample(after, "tessera:login_lockouts_total", 'surface="api"') - sample(
        before, "tessera:login_lockouts_total", 'surface="api"'
    )
    assert change == 1


def test_requests_without_credentials_are_not_guesses(guarded_server):
    """A scraper or browser without credentials is refused, but never locked out."""
    server = guarded_server
    for _ in range(MAX_FAILURES + 2):
        assert metrics(server).status_code == 401
        r = httpx.get(server.base_url + "/admin/v1/keys", timeout=30)
        assert r.status_code == 401
    assert metrics(server, METRICS_TOKEN).status_code == 200
