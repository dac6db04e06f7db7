"""Authentication core: Authorization header -> Principal, framework-free.

Interface:

    auth = Authenticator(db, mode="keys" | "static" | "none", static_keys=[...],
                         admin_token="..." | None, cache_ttl=2.0)
    principal = await auth.authenticate(request.headers.get("authorization"))
    admin = auth.authenticate_admin(request.headers.get("authorization"))
    principal = await auth.authenticate(header, admin=False)  # not the admin token (lockout)
    auth.check_model(principal, "model-name")      # 403 permission_denied
    auth.invalidate()                              # drop cached lookups (after admin edits)

Errors are api.server.errors.APIError: 401 invalid_api_key for a missing, malformed, oversized,
unknown, revoked or expired credential; 503 when the key database cannot be reached (an
outage is never reported as a bad key). The admin token is accepted wherever an API key is
and yields an unlimited principal with is_admin=True. Static keys (--api-key) are accepted
in "keys" mode too, as unlimited principals.

Key-lookup cache. Lookups are cached by the key's SHA-256 digest (never the plaintext),
positive and negative alike, for `cache_ttl` seconds (default 2 s) measured from when the
database read *started*. So a revocation, a rotation's end of grace or a changed limit made
on any replica is seen by every replica within `cache_ttl` of its commit (2 s by default;
the documented bound is 5 s, leaving room for clock skew and slow reads). Expiry times are
checked on every request against the cached row, so expiry is exact. The cache holds at
most `cache_size` entries (LRU). Concurrent lookups of the same digest share one query, and
at most `max_concurrent_lookups` queries run at once, so a flood of bad keys cannot exhaust
the connection pool; strings that are not shaped like a key never reach the database.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.exc import SQLAlchemyError

from api.db.models import utcnow
from api.db.session import Database
from api.keys.fields import has_limits
from api.keys.service import KEY_PREFIX, KeyRecord, KeyService, digest_key
from api.server.errors import APIError, invalid_api_key, permission_denied, unavailable

log = logging.getLogger(__name__)

AUTH_MODES = ("keys", "static", "none")
MAX_HEADER_LEN = 1024
DB_TIMEOUT = 5.0
# Printable ASCII without spaces; anything else in a credential is refused outright.
_TOKEN_RE = re.compile(rf"[\x21-\x7e]{{1,{MAX_HEADER_LEN}}}")
# tsr- + token_urlsafe(n >= 32): at least 43 url-safe characters.
_KEY_RE = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{43,200}")

# Errors that mean "the database is unreachable or broken", not "bad credentials".
DB_ERRORS: tuple[type[BaseException], ...] = (SQLAlchemyError, OSError, TimeoutError)


@dataclass(slots=True, frozen=True)
class Principal:
    key_id: str | None
    key_name: str
    allowed_models: tuple[str, ...] | None = None
    rpm_limit: int | None = None
    tpm_limit: int | None = None
    max_parallel: int | None = None
    token_budget: int | None = None
    budget_period: str = "total"
    priority: int = 0
    is_admin: bool = False
    # The key's tenant (api/tenants/service.py): the fair scheduler's unit and weight, the
    # prefix-cache scope ("key": the key's own salt; "tenant": one salt for the tenant's
    # keys; never across tenants), whether the tenant has limits of its own (quotas then
    # count its row too), and the tighter of the key's and the tenant's maximum request
    # duration in seconds (the API caps it with --request-timeout into the deadline).
    tenant_id: str | None = None
    tenant_name: str | None = None
    tenant_weight: float = 1.0
    cache_scope: str = "key"
    tenant_limited: bool = False
    request_timeout: float | None = None

    @property
    def has_limits(self) -> bool:
        return self.tenant_limited or has_limits(self)

    @classmethod
    def from_record(cls, record: KeyRecord) -> Principal:
        tenant = record.tenant
        durations = [record.max_request_seconds]
        if tenant is not None:
            durations.append(tenant.max_request_seconds)
        known = [d for d in durations if d is not None]
        return cls(
            key_id=record.id,
            key_name=record.name,
            allowed_models=record.allowed_models,
            rpm_limit=record.rpm_limit,
            tpm_limit=record.tpm_limit,
            max_parallel=record.max_parallel,
            token_budget=record.token_budget,
            budget_period=record.budget_period,
            priority=record.priority,
            tenant_id=record.tenant_id or None,
            tenant_name=tenant.name if tenant is not None else None,
            tenant_weight=tenant.weight if tenant is not None else 1.0,
            cache_scope=tenant.prefix_cache_scope if tenant is not None else "key",
            tenant_limited=tenant is not None and tenant.has_limits,
            request_timeout=min(known) if known else None,
        )


ADMIN = Principal(key_id=None, key_name="admin", is_admin=True)
STATIC = Principal(key_id=None, key_name="static")
ANONYMOUS = Principal(key_id=None, key_name="anonymous")


@dataclass(slots=True)
class _Entry:
    valid_until: float  # monotonic
    record: KeyRecord | None
    grace_until: datetime | None  # set when the digest is a pre-rotation secret


def parse_bearer(authorization: str | None) -> str:
    """The credential of an `Authorization: Bearer <token>` header, or APIError 401."""
    if not authorization:
        raise invalid_api_key(
            "Missing API key. Send it as an `Authorization: Bearer <key>` header."
        )
    if len(authorization) > MAX_HEADER_LEN + 16:
        raise invalid_api_key("The Authorization header is too long.")
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise invalid_api_key("Malformed Authorization header; expected `Bearer <key>`.")
    if not _TOKEN_RE.fullmatch(token):
        raise invalid_api_key("Malformed API key.")
    return token


def key_shaped(token: str) -> bool:
    """Shaped like a database API key (256 random bits: not worth guessing, never throttled)."""
    return _KEY_RE.fullmatch(token) is not None


def _same_secret(token: str, digest: bytes) -> bool:
    # Compare fixed-length digests so timing reveals neither content nor length.
    return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), digest)


class Authenticator:
    def __init__(
        self,
        db: Database | None,
        *,
        mode: str,
        static_keys: list[str],
        admin_token: str | None,
        cache_ttl: float = 2.0,
        cache_size: int = 10_000,
        max_concurrent_lookups: int = 8,
    ) -> None:
        if mode not in AUTH_MODES:
            raise ValueError(f"auth mode must be one of {', '.join(AUTH_MODES)}, got {mode!r}")
        if mode == "keys" and db is None:
            raise ValueError("auth mode 'keys' needs a database")
        if mode == "static" and not static_keys:
            raise ValueError("auth mode 'static' needs at least one API key (--api-key)")
        if not 0 <= cache_ttl <= 5:
            raise ValueError("cache_ttl must be between 0 and 5 seconds (the revocation bound)")
        if cache_size < 1:
            raise ValueError("cache_size must be at least 1")
        self.mode = mode
        self.cache_ttl = cache_ttl
        self._keys = KeyService(db) if db is not None else None
        self._static = [hashlib.sha256(k.encode()).digest() for k in static_keys]
        self._admin = hashlib.sha256(admin_token.encode()).digest() if admin_token else None
        self._cache: OrderedDict[str, _Entry] = OrderedDict()
        self._cache_size = cache_size
        self._inflight: dict[str, asyncio.Task[_Entry]] = {}
        self._max_lookups = max_concurrent_lookups
        self._lookup_slots: asyncio.Semaphore | None = None
        self.db_lookups = 0  # lookups that reached the database (for tests and metrics)

    @property
    def has_admin_token(self) -> bool:
        return self._admin is not None

    # -- inference routes -------------------------------------------------------------
    async def authenticate(self, authorization: str | None, *, admin: bool = True) -> Principal:
        """`admin=False`: the admin token is not compared (the caller's address is locked out
        after wrong admin tokens, api/server/login_throttle.py), so it gets 401 like any wrong key."""
        if self.mode == "none":
            return ANONYMOUS
        token = parse_bearer(authorization)
        if admin and self._admin is not None and _same_secret(token, self._admin):
            return ADMIN
        if any(_same_secret(token, d) for d in self._static):  # --api-key, in either mode
            return STATIC
        if self.mode == "static":
            raise invalid_api_key("Incorrect API key provided.")
        if not _KEY_RE.fullmatch(token):
            raise invalid_api_key("Incorrect API key provided.")
        entry = await self._lookup(digest_key(token))
        return self._principal(entry)

    def _principal(self, entry: _Entry) -> Principal:
        record, now = entry.record, utcnow()
        if record is None:
            raise invalid_api_key("Incorrect API key provided.")
        if record.revoked_at is not None:
            raise invalid_api_key("This API key has been revoked.")
        if record.expires_at is not None and record.expires_at <= now:
            raise invalid_api_key("This API key has expired.")
        if entry.grace_until is not None and entry.grace_until <= now:
            raise invalid_api_key("This API key was rotated and its grace period has ended.")
        if record.tenant is not None and record.tenant.disabled_at is not None:
            raise invalid_api_key("This API key's tenant has been disabled.")
        return Principal.from_record(record)

    async def _lookup(self, digest: str) -> _Entry:
        entry = self._cache.get(digest)
        if entry is not None and entry.valid_until > time.monotonic():
            self._cache.move_to_end(digest)
            return entry
        # One query per digest at a time; the query runs as its own task so that a
        # cancelled request does not cancel the lookup other requests are waiting on.
        task = self._inflight.get(digest)
        if task is None:
            task = asyncio.ensure_future(self._fetch(digest))
            self._inflight[digest] = task
            task.add_done_callback(lambda t: self._fetched(digest, t))
        return await asyncio.shield(task)

    def _fetched(self, digest: str, task: asyncio.Task[_Entry]) -> None:
        self._inflight.pop(digest, None)
        if not task.cancelled() and task.exception() is None:
            self._store(digest, task.result())

    async def _fetch(self, digest: str) -> _Entry:
        assert self._keys is not None
        if self._lookup_slots is None:
            self._lookup_slots = asyncio.Semaphore(self._max_lookups)
        started = time.monotonic()
        try:
            async with self._lookup_slots, asyncio.timeout(DB_TIMEOUT):
                self.db_lookups += 1
                found = await self._keys.find_by_digest(digest)
        except DB_ERRORS as exc:
            log.warning("API key lookup failed: database unavailable (%s)", type(exc).__name__)
            raise unavailable("The API key database is unavailable; try again shortly.") from None
        record, grace = found if found is not None else (None, None)
        return _Entry(started + self.cache_ttl, record, grace)

    def _store(self, digest: str, entry: _Entry) -> None:
        self._cache[digest] = entry
        self._cache.move_to_end(digest)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)

    def invalidate(self) -> None:
        """Forget every cached lookup (this replica sees its own admin edits at once)."""
        self._cache.clear()

    # -- admin routes -------------------------------------------------------------------
    def authenticate_admin(self, authorization: str | None) -> Principal:
        if self._admin is None:
            raise invalid_api_key("The admin API is disabled: no admin token is configured.")
        token = parse_bearer(authorization)
        if not _same_secret(token, self._admin):
            raise invalid_api_key("Incorrect admin token provided.")
        return ADMIN

    # -- authorisation ------------------------------------------------------------------
    def check_model(self, principal: Principal, model: str) -> None:
        allowed = principal.allowed_models
        if allowed is not None and model not in allowed:
            raise permission_denied(f"This API key is not allowed to use the model `{model}`.")


__all__ = [
    "ADMIN",
    "ANONYMOUS",
    "APIError",
    "AUTH_MODES",
    "Authenticator",
    "DB_ERRORS",
    "Principal",
    "STATIC",
    "key_shaped",
    "parse_bearer",
]
