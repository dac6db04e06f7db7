"""Stored responses (store: true): written once a request succeeded, read for GET and for
previous_response_id, deleted by DELETE.

Who may see a stored response: every key of the tenant whose key created it (a tenant is a
team; its keys share conversations as they share budgets). Principals without a tenant row
(static --api-key keys, auth none, the admin token) see what their kind created. Anyone
else gets None here, which the routes answer as 404: an id owned elsewhere reads exactly
like an unknown one.

    store = ResponseStore(db)
    await store.save(principal, response_body, input_items, previous_id)
    row = await store.get(principal, "resp_...")        # None: unknown or not yours
    deleted = await store.delete(principal, "resp_...")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, select

from api.db.models import StoredResponse, utcnow
from api.db.session import Database
from api.keys.auth import Principal


def owner_of(principal: Principal) -> str:
    if principal.tenant_id:
        return f"tenant:{principal.tenant_id}"
    if principal.key_id:  # a key row without a tenant (not made by today's code)
        return f"key:{principal.key_id}"
    return f"principal:{principal.key_name}"


@dataclass(slots=True, frozen=True)
class Stored:
    id: str
    input_items: list[dict[str, Any]]
    response: dict[str, Any]


class ResponseStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def save(
        self,
        principal: Principal,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        previous_response_id: str | None,
    ) -> None:
        row = StoredResponse(
            id=response["id"],
            owner=owner_of(principal),
            key_id=principal.key_id,
            created_at=utcnow(),
            previous_response_id=previous_response_id,
            input_items=input_items,
            response=response,
        )
        async with self.db.session(write=True) as s:
            s.add(row)
            await s.commit()

    async def get(self, principal: Principal, response_id: str) -> Stored | None:
        query = select(StoredResponse).where(
            StoredResponse.id == response_id, StoredResponse.owner == owner_of(principal)
        )
        async with self.db.session() as s:
            row = (await s.execute(query)).scalar_one_or_none()
        if row is None:
            return None
        return Stored(row.id, list(row.input_items), dict(row.response))

    async def delete(self, principal: Principal, response_id: str) -> bool:
        query = delete(StoredResponse).where(
            StoredResponse.id == response_id, StoredResponse.owner == owner_of(principal)
        )
        async with self.db.session(write=True) as s:
            result = await s.execute(query)
            await s.commit()
        return bool(result.rowcount)
