"""Who may call and what they may spend: the authenticator and the database-backed services
(keys, quotas, usage ledger), built from Settings and started and stopped with the app.

    access = Access(settings, metrics)      # no I/O but the admin-token file; app.state entries
    await access.start()                    # schema check / SQLite migration, first key, ledger
    await access.stop()                     # after in-flight requests drained: releases, flush

Modes (settings.auth):
    keys    keys from the database (plus any --api-key); quotas and the usage ledger. The
            database is settings.database_url, else SQLite in the data dir.
    static  only the --api-key keys, vLLM-compatible; a database (and so the ledger and the
            admin key API) only when --database-url is given.
    none    every request is allowed; said loudly at start.

On start, SQLite is migrated to the current schema; a Postgres database that is not is
refused with api.db.session.SchemaOutOfDate naming `tessera db upgrade`. In keys mode an
empty key table gets one key, printed once with the admin token if that was just created
(api/server/bootstrap.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from api.db.session import Database, redact
from api.db.timeout import TimedService
from api.keys.auth import Authenticator
from api.keys.service import KeyService
from api.openai.responses.store import ResponseStore
from api.quotas.service import QuotaService
from api.server.bootstrap import (
    ADMIN_TOKEN_FILE,
    load_or_create_admin_token,
    print_banner,
    warn_open_server,
    warn_short_secrets,
)
from api.server.login_throttle import LoginThrottle
from api.tenants.service import TenantService
from api.usage.accounting import Accountant
from api.usage.service import UsageRecorder

if TYPE_CHECKING:
    from api.server.metrics import Metrics
    from api.server.settings import Settings

log = logging.getLogger("tessera.api")

# Revocations and limit changes made on another replica are seen within this many seconds.
KEY_CACHE_TTL_S = 2.0


class Access:
    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.db: Database | None = None
        if settings.uses_database:
            self.db = Database.from_url(settings.resolved_database_url())
        self._new_admin_token = False
        if settings.admin_token is None and settings.auth == "keys":
            token, created = load_or_create_admin_token(settings.resolved_data_dir())
            # The console signs its sessions with the admin token: it reads it from settings.
            settings.admin_token = token
            self._new_admin_token = created
        self.authenticator = Authenticator(
            self.db if settings.auth == "keys" else None,
            mode=settings.auth,
            static_keys=list(settings.api_key),
            admin_token=settings.admin_token,
            cache_ttl=KEY_CACHE_TTL_S,
        )
        self.keys = KeyService(self.db) if self.db is not None else None
        self.tenants = TenantService(self.db) if self.db is not None else None
        self.recorder = UsageRecorder(self.db) if self.db is not None else None
        # /v1/responses with store: true (api/openai/responses/store.py)
        self.responses = ResponseStore(self.db) if self.db is not None else None
        quotas = QuotaService(self.db) if self.db is not None else None
        self.accountant = Accountant(quotas, self.recorder, metrics)
        # Wrong admin / metrics tokens, per client: the console login, the admin API, /metrics;
        # and apart, the admin token presented as an API key (api/server/login_throttle.py).
        limits = (settings.login_max_failures, settings.login_failure_window)
        self.login_throttle = LoginThrottle(
            *limits,
            metrics=metrics,
            consequence="the console, the admin API and a protected /metrics refuse it (429)",
        )
        self.api_login_throttle = LoginThrottle(
            *limits,
            metrics=metrics,
            consequence="the admin token is not accepted from it as an API key meanwhile",
        )

    def state_entries(self) -> dict[str, Any]:
        """What routes, guards, the admin API and the console read from app.state."""
        entries: dict[str, Any] = {
            "authenticator": self.authenticator,
            "accountant": self.accountant,
            "login_throttle": self.login_throttle,
            "api_login_throttle": self.api_login_throttle,
        }
        if self.keys is not None:
            # The admin REST API and the console: every call under --db-timeout.
            entries["keys"] = TimedService(self.keys, self.settings.db_timeout)
            entries["tenants"] = TimedService(self.tenants, self.settings.db_timeout)
            entries["usage_recorder"] = self.recorder
        if self.responses is not None:
            entries["response_store"] = TimedService(self.responses, self.settings.db_timeout)
        return entries

    async def start(self) -> None:
        if self.settings.auth == "none":
            warn_open_server()
        warn_short_secrets(self.settings.admin_token, self.settings.metrics_token)
        if self.db is None:
            return
        await self.db.ensure_schema()
        log.info("Keys, quotas and usage in %s", redact(self.db.url))
        first_key = None
        if self.settings.auth == "keys":
            assert self.keys is not None
            first_key = await self.keys.ensure_bootstrap("default")
        assert self.recorder is not None
        await self.recorder.start()
        data_dir = self.settings.resolved_data_dir()
        print_banner(
            base_url=_base_url(self.settings),
            api_key=first_key,
            admin_token=self.settings.admin_token if self._new_admin_token else None,
            admin_token_file=Path(data_dir) / ADMIN_TOKEN_FILE,
        )
        self._new_admin_token = False

    async def stop(self) -> None:
        """Call after in-flight requests ended: their releases finish, the ledger is flushed."""
        try:
            await self.accountant.aclose()
            if self.recorder is not None:
                await self.recorder.stop()
        finally:
            if self.db is not None:
                await self.db.dispose()


async def check_database(settings: Settings) -> None:
    """Before serving: migrate SQLite, or raise SchemaOutOfDate for an un-migrated Postgres.
    Connection errors propagate (the CLI reports them and exits non-zero)."""
    if not settings.uses_database:
        return
    db = Database.from_url(settings.resolved_database_url())
    try:
        await db.ensure_schema()
    finally:
        await db.dispose()


def _base_url(settings: Settings) -> str:
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"
