"""Two `tessera serve` processes sharing one Postgres database, as replicas behind a load
balancer would: a key revoked through one replica's admin API is refused by the other within
the documented delay (the key-lookup cache TTL, 2 s; the bound is 5 s), and a token budget is
shared between them, not doubled.
"""

from __future__ import annotations

import time

import pytest

from tests.api.keys_http import (
    ADMIN_TOKEN,
    MODEL,
    Admin,
    complete,
    fresh_database,
    migrate,
    prompt_tokens,
)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

REVOCATION_BOUND_S = 5.0


@pytest.fixture(scope="module")
def replicas(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    with fresh_database("postgres", tmp) as url:
        migrate(url)
        servers = [
            start_server(
                tiny_llama_dir,
                "--served-model-name",
                MODEL,
                "--database-url",
                url,
                "--data-dir",
                str(tmp / name),
                "--admin-token",
                ADMIN_TOKEN,
            )  # fmt: skip
            for name in ("a", "b")
        ]
        yield servers


def test_revocation_on_one_replica_reaches_the_other(replicas):
    a, b = replicas
    key_id, key = Admin(a).create_key("revoke-me")
    assert complete(b, key).status_code == 200  # now in b's key-lookup cache
    Admin(a).revoke(key_id)
    revoked = time.monotonic()
    assert complete(a, key).status_code == 401  # a dropped its own cache at once
    while (r := complete(b, key)).status_code == 200:
        assert time.monotonic() - revoked < REVOCATION_BOUND_S, "b still serves a revoked key"
        time.sleep(0.1)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert time.monotonic() - revoked < REVOCATION_BOUND_S


def test_budget_is_shared_not_doubled(replicas):
    a, b = replicas
    admin = Admin(a)
    _, probe = admin.create_key()
    cost = prompt_tokens(a, probe, "Hello") + 4  # complete() asks for 4 tokens, ignore_eos
    key_id, key = admin.create_key(token_budget=4 * cost)
    statuses = [complete(server, key).status_code for server in (a, b, a, b, a, b)]
    assert statuses == [200, 200, 200, 200, 429, 429]
    assert Admin(b).key(key_id)["budget_used"] == 4 * cost
    # Both replicas' ledgers land in the one database.
    usage = admin.usage(key_id)
    assert (usage["requests"], usage["errors"]) == (6, 2)  # the 429s have rows too
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 4 * cost


def test_rate_limit_counts_across_replicas(replicas):
    a, b = replicas
    _, key = Admin(a).create_key(rpm_limit=2)
    assert complete(a, key).status_code == 200
    assert complete(b, key).status_code == 200
    for server in (a, b):
        r = complete(server, key)
        assert r.status_code == 429 and r.headers["x-ratelimit-remaining-requests"] == "0"
