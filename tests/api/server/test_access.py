"""The access layer's settings and start-up, in-process: which auth mode the flags select, the
admin token kept across restarts, and the loud warning of an open server."""

from __future__ import annotations

import asyncio

import pytest

from api.server.access import Access
from api.server.bootstrap import load_or_create_admin_token
from api.server.settings import Settings


def settings(argv: list[str], env: dict[str, str] | None = None) -> Settings:
    return Settings.from_argv(argv, env or {})


def test_auth_mode_follows_the_flags():
    assert settings([]).auth == "keys"
    assert settings(["--api-key", "k"]).auth == "static"  # vLLM's `--api-key K`
    assert settings([], {"TESSERA_API_KEY": "k"}).auth == "static"
    both = settings(["--auth", "keys", "--api-key", "k"])
    assert both.auth == "keys" and both.api_key == ["k"]
    assert settings(["--auth", "none"]).auth == "none"
    with pytest.raises(ValueError, match="--auth static needs at least one --api-key"):
        settings(["--auth", "static"])


def test_which_modes_use_a_database(tmp_path):
    assert settings(["--data-dir", str(tmp_path)]).uses_database
    assert not settings(["--api-key", "k"]).uses_database
    assert not settings(["--auth", "none"]).uses_database
    url = f"sqlite+aiosqlite:///{tmp_path}/x.db"
    s = settings(["--auth", "none", "--database-url", url])
    assert s.uses_database and s.resolved_database_url() == url
    s = settings(["--data-dir", str(tmp_path)])
    assert s.resolved_database_url() == f"sqlite+aiosqlite:///{tmp_path.resolve()}/tessera.db"


def test_data_dir_defaults_agree_with_the_db_commands(monkeypatch, tmp_path):
    from api.db.session import resolve_database_url

    monkeypatch.setenv("TESSERA_DATA_DIR", str(tmp_path))
    assert settings([]).resolved_database_url() == resolve_database_url(None, None)


def test_scheduling_policy_reaches_the_engine_config():
    # fair where API keys tell tenants apart, fcfs on an open server; a flag always wins.
    assert settings([]).create_engine_config().scheduler.policy == "fair"
    assert settings(["--api-key", "k"]).create_engine_config().scheduler.policy == "fair"
    assert settings(["--auth", "none"]).create_engine_config().scheduler.policy == "fcfs"
    s = settings(["--scheduling-policy", "priority"])
    assert s.create_engine_config().scheduler.policy == "priority"
    s = settings(["--auth", "none"], {"TESSERA_SCHEDULING_POLICY": "fair"})
    assert s.create_engine_config().scheduler.policy == "fair"


def test_request_timeout_is_positive_seconds_or_none():
    assert settings([]).request_timeout is None
    assert settings(["--request-timeout", "2.5"]).request_timeout == 2.5
    assert settings([], {"TESSERA_REQUEST_TIMEOUT": "none"}).request_timeout is None
    with pytest.raises(ValueError, match="request_timeout must be positive"):
        settings(["--request-timeout", "0"])


def test_admin_token_is_created_once_and_kept_private(tmp_path):
    token, created = load_or_create_admin_token(tmp_path / "data")
    assert created and token.startswith("tsa-") and len(token) > 40
    assert (tmp_path / "data" / "admin_token").stat().st_mode & 0o777 == 0o600
    assert load_or_create_admin_token(tmp_path / "data") == (token, False)


def test_keys_mode_uses_the_stored_admin_token(tmp_path):
    token, _ = load_or_create_admin_token(tmp_path)
    s = Settings(data_dir=str(tmp_path))
    access = Access(s)
    assert s.admin_token == token  # the console signs sessions with it
    assert access.authenticator.authenticate_admin(f"Bearer {token}").is_admin
    given = Settings(data_dir=str(tmp_path), admin_token="tsa-given")
    Access(given)
    assert given.admin_token == "tsa-given"


def test_auth_none_says_so_loudly(capsys):
    access = Access(Settings(auth="none"))
    assert access.db is None and "keys" not in access.state_entries()
    asyncio.run(access.start())
    assert "WARNING: --auth none" in capsys.readouterr().err
    asyncio.run(access.stop())
