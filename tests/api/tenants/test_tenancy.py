"""api/tenants/tenancy.py: what the engine is told about a request's tenant."""

from __future__ import annotations

from api.keys.auth import ANONYMOUS, STATIC, Principal
from api.tenants.tenancy import cache_salt, effective_priority, engine_tenancy, request_timeout

SECRET = b"s" * 32


def key(key_id: str, tenant: str | None = None, **kw) -> Principal:
    return Principal(key_id=key_id, key_name=key_id, tenant_id=tenant or key_id, **kw)


def test_each_key_has_its_own_salt_that_names_nothing():
    a, b = cache_salt(key("a"), SECRET), cache_salt(key("b"), SECRET)
    assert a and b and a != b
    assert cache_salt(key("a"), SECRET) == a  # stable while the server runs
    assert cache_salt(key("a"), b"t" * 32) != a  # keyed by the server's secret
    assert len(a) == 32 and "key" not in a


def test_the_tenant_scope_shares_within_a_tenant_only():
    k1 = key("k1", tenant="team", cache_scope="tenant")
    k2 = key("k2", tenant="team", cache_scope="tenant")
    other = key("k3", tenant="other", cache_scope="tenant")
    assert cache_salt(k1, SECRET) == cache_salt(k2, SECRET) != cache_salt(other, SECRET)
    assert cache_salt(k1, SECRET) != cache_salt(key("k1", tenant="team"), SECRET)


def test_callers_without_a_key_share_the_unsalted_cache():
    assert cache_salt(STATIC, SECRET) is None and cache_salt(ANONYMOUS, SECRET) is None


def test_a_request_may_lower_its_priority_but_not_raise_it_past_its_key():
    p = key("a", priority=5)
    assert effective_priority(p, None) == 5
    assert effective_priority(p, 0) == 5  # better than the key's allowance: capped
    assert effective_priority(p, 9) == 9  # a batch job stepping aside is fine


def test_the_tighter_timeout_wins_and_becomes_a_deadline():
    assert request_timeout(key("a"), None) is None
    assert request_timeout(key("a"), 30.0) == 30.0
    assert request_timeout(key("a", request_timeout=5.0), 30.0) == 5.0
    t = engine_tenancy(key("a", tenant_weight=2.0), SECRET, None, 100.0, 30.0)
    assert (t.tenant, t.weight, t.deadline, t.priority) == ("a", 2.0, 130.0, 0)
    assert engine_tenancy(STATIC, SECRET, None, 100.0, None).tenant is None


def test_a_requests_cache_salt_splits_its_scope_and_never_reaches_another():
    a = cache_salt(key("a"), SECRET)
    salted = cache_salt(key("a"), SECRET, "x")
    assert salted not in (a, None) and cache_salt(key("a"), SECRET, "x") == salted
    assert cache_salt(key("a"), SECRET, "y") != salted
    assert cache_salt(key("b"), SECRET, "x") != salted  # the same salt under another key
    # an open or static server: the request's salt alone (no salt: everything shared)
    assert cache_salt(ANONYMOUS, SECRET, "x") not in (None, salted)
    assert cache_salt(STATIC, SECRET, "x") == cache_salt(ANONYMOUS, SECRET, "x")
