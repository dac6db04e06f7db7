"""Console sessions and CSRF tokens: signed, stateless, keyed by the admin token.

A session cookie is `<expires>.<nonce>.<signature>`, signed with a key derived from the admin
token, so it is valid on every replica that shares the token and becomes invalid the moment
the token changes. The CSRF token of a session is another MAC of its nonce: a page can embed
it, another site can neither read nor forge it. The login form, which has no session yet,
uses a short-lived login cookie the same way (double submit, bound by the MAC).
Logging out forgets the nonce on this replica (SessionRevocations) and clears the cookie.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

SESSION_COOKIE = "tessera_console"
LOGIN_COOKIE = "tessera_console_login"
SESSION_TTL_S = 12 * 3600
LOGIN_TTL_S = 3600
CSRF_FIELD = "_csrf"
CSRF_HEADER = "x-csrf-token"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(slots=True, frozen=True)
class Session:
    nonce: str
    expires: int  # epoch seconds
    csrf: str


class SessionSigner:
    def __init__(self, admin_token: str) -> None:
        if not admin_token:
            raise ValueError("the console needs an admin token (--admin-token)")
        self._key = hmac.new(b"tessera-console-v1", admin_token.encode(), hashlib.sha256).digest()
        self._token_digest = hashlib.sha256(admin_token.encode()).digest()

    def _mac(self, purpose: str, message: str) -> str:
        return _b64(hmac.new(self._key, f"{purpose}|{message}".encode(), hashlib.sha256).digest())

    def token_matches(self, token: str) -> bool:
        """Constant-time check of a typed admin token (digests, so length leaks nothing)."""
        given = hashlib.sha256(token.strip().encode()).digest()
        return hmac.compare_digest(given, self._token_digest)

    def issue(self, now: float | None = None) -> tuple[str, Session]:
        expires = int((now if now is not None else time.time()) + SESSION_TTL_S)
        nonce = secrets.token_urlsafe(18)
        payload = f"{expires}.{nonce}"
        cookie = f"{payload}.{self._mac('session', payload)}"
        return cookie, Session(nonce, expires, self._mac("csrf", nonce))

    def verify(self, cookie: str | None, now: float | None = None) -> Session | None:
        if not cookie or len(cookie) > 256:
            return None
        payload, _, signature = cookie.rpartition(".")
        expires_text, _, nonce = payload.partition(".")
        if not nonce or not expires_text.isdigit():
            return None
        if not hmac.compare_digest(signature, self._mac("session", payload)):
            return None
        expires = int(expires_text)
        if expires <= (now if now is not None else time.time()):
            return None
        return Session(nonce, expires, self._mac("csrf", nonce))

    def login_nonce(self) -> str:
        return secrets.token_urlsafe(18)

    def login_csrf(self, nonce: str) -> str:
        return self._mac("login", nonce)

    @staticmethod
    def same(expected: str, given: str | None) -> bool:
        return bool(given) and hmac.compare_digest(expected.encode(), str(given).encode())


@dataclass(slots=True)
class SessionRevocations:
    """Nonces of sessions logged out on this replica, kept until they would expire anyway."""

    _until: dict[str, int] = field(default_factory=dict)

    def revoke(self, session: Session) -> None:
        now = time.time()
        self._until = {n: t for n, t in self._until.items() if t > now}
        self._until[session.nonce] = session.expires

    def __contains__(self, session: Session) -> bool:
        return session.nonce in self._until
