"""What the engine is told about a request's tenant: who it is (the fair scheduler's unit),
its weight, the prefix-cache salt that isolates it, its priority class and its deadline.

    tenancy = engine_tenancy(principal, secret, requested_priority, arrived, server_timeout)
    engine.generate(EngineRequest(request_id, prompt_ids, params, tenancy))  # engine.protocol

Cache salt: HMAC-SHA256 of the scope's id under a secret drawn when the server starts, so
the salt (which the engine hashes into every block of a prompt) names no tenant and cannot
be recomputed from outside; blocks of two scopes never match, so no tenant can time
another's prompts through prefix hits. The scope is the key (the default) or, where the
principal says so, the whole tenant (its keys share a common system prompt, say). Callers
without a key (the admin token, static --api-key keys, an open server) share one unsalted
cache, as before.

Priority: a request may ask for a `priority` (vLLM's extra; lower runs first), but never a
better class than its key's own: the key's priority is its allowance.
"""

from __future__ import annotations

import hashlib
import hmac

from api.keys.auth import Principal
from engine.protocol import Tenancy


def cache_salt(principal: Principal, secret: bytes, requested: str | None = None) -> str | None:
    """The salt of the request's prefix-cache block hashes: its key's or tenant's scope (so
    scopes never share blocks), and within it the request's own `cache_salt` (vLLM's field:
    requests with different salts share nothing either, and no salt can reach another
    scope's blocks)."""
    if principal.cache_scope == "tenant" and principal.tenant_id is not None:
        scope = f"tenant:{principal.tenant_id}"
    elif principal.key_id is not None:
        scope = f"key:{principal.key_id}"
    elif requested is None:
        return None
    else:
        scope = "open"
    if requested is not None:
        scope += "|salt:" + requested
    return hmac.new(secret, scope.encode(), hashlib.sha256).hexdigest()[:32]


def effective_priority(principal: Principal, requested: int | None) -> int:
    return principal.priority if requested is None else max(requested, principal.priority)


def request_timeout(principal: Principal, server_timeout: float | None) -> float | None:
    """The tighter of the server's --request-timeout and the key's own limit, if any."""
    limits = [t for t in (server_timeout, principal.request_timeout) if t is not None]
    return min(limits) if limits else None


def engine_tenancy(
    principal: Principal,
    secret: bytes,
    requested_priority: int | None,
    arrived: float,
    server_timeout: float | None,
    requested_salt: str | None = None,
) -> Tenancy:
    timeout = request_timeout(principal, server_timeout)
    return Tenancy(
        tenant=principal.tenant_id,
        weight=principal.tenant_weight,
        cache_salt=cache_salt(principal, secret, requested_salt),
        priority=effective_priority(principal, requested_priority),
        deadline=None if timeout is None else arrived + timeout,
    )
