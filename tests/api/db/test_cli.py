"""`tessera keys ...` / `tessera db ...` through the argparse builders, on a real database."""

from __future__ import annotations

import argparse
import asyncio
import io
import json

import pytest

from api.cli.db import add_subcommands, main
from api.db.migrate import head_revisions
from api.db.session import Database, resolve_database_url
from api.keys.auth import Authenticator
from api.server.errors import APIError


def run(argv: list[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="tessera")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    return args.handler(args, out), out.getvalue()


def authenticate(url: str, key: str) -> str | int:
    async def go() -> str | int:
        db = Database.from_url(url)
        try:
            auth = Authenticator(db, mode="keys", static_keys=[], admin_token=None)
            return (await auth.authenticate(f"Bearer {key}")).key_name
        except APIError as exc:
            return exc.status_code
        finally:
            await db.dispose()

    return asyncio.run(go())


def test_db_commands(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = ["--database-url", database_url]
    code, out = run(["db", "current", *url])
    assert code == 0 and "(empty: no migrations applied)" in out
    code, _ = run(["db", "check", *url])
    assert code == 1 and "run `tessera db upgrade" in capsys.readouterr().err
    code, out = run(["db", "upgrade", *url])
    (head,) = head_revisions()  # the newest migration in migrations/versions
    assert code == 0 and f"upgraded to revision {head}" in out
    code, out = run(["db", "upgrade", *url])
    assert code == 0 and f"already at revision {head}" in out
    assert run(["db", "current", *url]) == (0, f"{head} (head)\n")
    code, out = run(["db", "check", *url])
    assert code == 0 and "up to date" in out


def test_keys_create_list_rotate_revoke(
    database_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    url = ["--database-url", database_url]
    if not database_url.startswith("sqlite"):
        # An un-migrated Postgres is refused with the command that fixes it.
        code, _ = run(["keys", "list", *url])
        assert code == 1 and "tessera db upgrade" in capsys.readouterr().err
        assert run(["db", "upgrade", *url])[0] == 0
    code, out = run(
        [
            "keys",
            "create",
            "team-a",
            "--rpm",
            "60",
            "--allowed-models",
            "m1, m2",
            "--budget-period",
            "day",
            "--token-budget",
            "5000",
            "--metadata",
            '{"owner": "a"}',
            "--expires-in-days",
            "30",
            *url,
        ]
    )
    assert code == 0, capsys.readouterr().err
    lines = out.strip().splitlines()
    key = lines[-1]
    assert key.startswith("tsr-") and "not shown again" in out
    assert authenticate(database_url, key) == "team-a"

    code, out = run(["keys", "create", "b", "--json", *url])
    created = json.loads(out)
    assert code == 0 and created["key"].startswith("tsr-") and created["name"] == "b"

    code, out = run(["keys", "list", *url])
    assert code == 0 and "team-a" in out and "rpm=60" in out and "budget/day=5000" in out
    assert key not in out and key[:12] in out
    code, out = run(["keys", "list", "--json", *url])
    listed = json.loads(out)
    assert [k["name"] for k in listed] == ["team-a", "b"]
    assert listed[0]["allowed_models"] == ["m1", "m2"] and listed[0]["metadata"] == {"owner": "a"}
    assert all("key" not in k for k in listed)

    team_id = listed[0]["id"]
    code, out = run(["keys", "rotate", team_id, "--grace-seconds", "0", *url])
    new_key = out.strip().splitlines()[-1]
    assert code == 0 and new_key != key
    assert authenticate(database_url, key) == 401
    assert authenticate(database_url, new_key) == "team-a"

    code, out = run(["keys", "revoke", team_id, *url])
    assert code == 0 and f"Revoked {team_id}" in out
    assert authenticate(database_url, new_key) == 401
    code, out = run(["keys", "list", "--active", "--json", *url])
    assert [k["name"] for k in json.loads(out)] == ["b"]

    code, _ = run(["keys", "revoke", "no-such-id", *url])
    assert code == 2 and "no API key with id 'no-such-id'" in capsys.readouterr().err
    code, _ = run(["keys", "create", "x", "--priority", "5000", *url])
    assert code == 2 and "priority must be" in capsys.readouterr().err


def test_keys_create_migrates_a_fresh_sqlite_database(tmp_path) -> None:
    assert main(["keys", "create", "first", "--data-dir", str(tmp_path / "state")]) == 0
    assert (tmp_path / "state" / "tessera.db").is_file()


def test_bad_arguments_and_urls(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        run(["keys", "create", "x", "--rpm", "0"])
    assert exc.value.code == 2 and "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        run(["keys", "create", "x", "--metadata", "[1]"])
    assert run(["db", "current", "--database-url", "mysql://u@h/db"])[0] == 2
    assert "unsupported database URL" in capsys.readouterr().err


def test_database_url_resolution(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TESSERA_DATABASE_URL", raising=False)
    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path))
    assert resolve_database_url(None, None) == f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}"
    assert resolve_database_url(None, tmp_path / "x").endswith("/x/tessera.db")
    monkeypatch.setenv("TESSERA_DATABASE_URL", "postgresql+asyncpg://h/db")
    assert resolve_database_url(None, None) == "postgresql+asyncpg://h/db"
    assert resolve_database_url("sqlite:///a.db", None) == "sqlite:///a.db"


def test_tenants_create_list_update_delete(database_url: str, capsys) -> None:
    url = ["--database-url", database_url]
    if not database_url.startswith("sqlite"):
        assert run(["db", "upgrade", *url])[0] == 0
    code, out = run(["tenants", "create", "team-a", "--weight", "2", "--token-budget", "500",
                     "--json", *url])  # fmt: skip
    assert code == 0, capsys.readouterr().err
    tenant = json.loads(out)
    assert (tenant["weight"], tenant["token_budget"]) == (2.0, 500)
    assert run(["tenants", "create", "team-a", *url])[0] == 2
    assert "already exists" in capsys.readouterr().err

    code, out = run(["keys", "create", "k1", "--tenant", tenant["id"],
                     "--max-request-seconds", "30", "--json", *url])  # fmt: skip
    key = json.loads(out)
    assert code == 0 and key["tenant_id"] == tenant["id"] and key["max_request_seconds"] == 30
    assert run(["keys", "create", "k2", "--tenant", "nope", *url])[0] == 2
    assert "no tenant with id 'nope'" in capsys.readouterr().err
    code, out = run(["keys", "list", "--tenant", tenant["id"], *url])
    assert code == 0 and "k1" in out and "team-a" in out

    code, out = run(["tenants", "update", tenant["id"], "--token-budget", "none",
                     "--prefix-cache-scope", "tenant", "--json", *url])  # fmt: skip
    updated = json.loads(out)
    assert updated["token_budget"] is None and updated["prefix_cache_scope"] == "tenant"
    assert updated["weight"] == 2.0  # left alone
    assert run(["tenants", "update", tenant["id"], *url])[0] == 2  # nothing to change

    code, out = run(["tenants", "list", *url])
    assert code == 0 and "team-a" in out and "unlimited" in out
    assert authenticate(database_url, key["key"]) == "k1"
    code, out = run(["tenants", "delete", tenant["id"], *url])
    assert code == 0 and "Disabled" in out
    assert authenticate(database_url, key["key"]) == 401
    assert "team-a" not in run(["tenants", "list", "--active", *url])[1]
    assert run(["tenants", "update", tenant["id"], "--enable", *url])[0] == 0
    assert authenticate(database_url, key["key"]) == "k1"
    assert run(["tenants", "delete", "nope", *url])[0] == 2
