"""api/server/affinity.py: the per-tenant key proxies hash on is stable, distinct and not the secret."""

from __future__ import annotations

import dataclasses
import re

from api.keys.auth import STATIC, Principal
from api.server.affinity import affinity_key


def test_key_depends_on_the_id_only_and_is_short_hex():
    a = Principal(key_id="k1", key_name="team-a")
    renamed = dataclasses.replace(a, key_name="team-a-renamed", rpm_limit=5)
    assert affinity_key(a) == affinity_key(renamed)  # limits and names do not move a tenant
    assert affinity_key(a) != affinity_key(Principal(key_id="k2", key_name="team-a"))
    assert re.fullmatch(r"[0-9a-f]{16}", affinity_key(a))


def test_a_tenant_id_wins_over_the_key_and_static_keys_share_one():
    @dataclasses.dataclass(frozen=True)
    class WithTenant(Principal):  # what Principal looks like once tenants land
        tenant_id: str | None = None

    one = WithTenant(key_id="k1", key_name="x", tenant_id="t")
    two = WithTenant(key_id="k2", key_name="y", tenant_id="t")
    assert affinity_key(one) == affinity_key(two) != affinity_key(Principal("k1", "x"))
    assert affinity_key(STATIC) == affinity_key(Principal(key_id=None, key_name="static"))
