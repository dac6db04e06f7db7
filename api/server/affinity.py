"""The per-tenant affinity key a proxy can hash on to keep a tenant on one replica.

    X-Tessera-Affinity: 3f9c0a51e2d47b18      (every authenticated response)

Stable and not secret: 16 hex digits of SHA-256 over the key's tenant id (or the key's id
where it has none), or the name of a static --api-key key. It names no
secret and survives a key rotation (the id stays). A gateway that authenticates clients itself
can send it back as a request header (deploy/nginx hashes on it first, then X-Tenant, then the
Authorization header); see README's *Deployment*.
"""

from __future__ import annotations

import hashlib
from typing import Any

from api.server.guards import PRINCIPAL_STATE_KEY

HEADER = "x-tessera-affinity"


def affinity_key(principal: Any) -> str:
    tenant = getattr(principal, "tenant_id", None)
    ident = (
        f"tenant:{tenant}"
        if tenant
        else f"key:{principal.key_id}"
        if principal.key_id
        else f"name:{principal.key_name}"
    )
    return hashlib.sha256(b"tessera-affinity\0" + ident.encode()).hexdigest()[:16]


class AffinityHeaderMiddleware:
    """Adds X-Tessera-Affinity to the response of any request a guard authenticated with an
    API key (the admin token is no tenant: its responses carry none)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_wrapper(message: Any) -> None:
            if message["type"] == "http.response.start":
                principal = (scope.get("state") or {}).get(PRINCIPAL_STATE_KEY)
                if principal is not None and not getattr(principal, "is_admin", False):
                    headers = list(message.get("headers") or [])
                    headers.append((HEADER.encode(), affinity_key(principal).encode()))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_wrapper)
