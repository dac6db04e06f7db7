"""The keys page: list, create (the secret shown once), edit limits, rotate, revoke.

GET  /console/keys                 page; the keys panel alone for htmx
POST /console/keys                 create -> panel with the new secret
GET  /console/keys/{key_id}/edit   the edit form (partial for htmx, else a page)
POST /console/keys/{key_id}        save the edit form -> panel
POST /console/keys/{key_id}/rotate new secret (old one valid for `grace_seconds`) -> panel
POST /console/keys/{key_id}/revoke revoke -> panel

Every change drops this replica's key-lookup cache (app.state.authenticator), so a revoked
key is refused here at once and on other replicas within the cache TTL.
"""

from __future__ import annotations

from datetime import UTC, datetime, time
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.params import FromPath

from api.keys.service import BUDGET_PERIODS, DEFAULT_ROTATE_GRACE, KeyNotFound
from console.render import is_htmx, page
from console.state import keys_of

LIMIT_FIELDS = ("rpm_limit", "tpm_limit", "max_parallel", "token_budget")


def parse_key_form(form: Any) -> dict[str, Any]:
    """Form fields -> KeyService fields. Empty limit = unlimited. ValueError names the field."""
    out: dict[str, Any] = {"name": str(form.get("name") or "").strip()}
    for name in LIMIT_FIELDS:
        text = str(form.get(name) or "").strip()
        try:
            out[name] = int(text) if text else None
        except ValueError:
            raise ValueError(f"{name} must be a whole number, or empty for unlimited") from None
    period = str(form.get("budget_period") or "total")
    out["budget_period"] = period
    text = str(form.get("priority") or "").strip()
    try:
        out["priority"] = int(text) if text else 0
    except ValueError:
        raise ValueError("priority must be a whole number (lower runs first)") from None
    models = [m.strip() for m in str(form.get("allowed_models") or "").split(",") if m.strip()]
    out["allowed_models"] = models or None
    text = str(form.get("expires_at") or "").strip()
    try:
        out["expires_at"] = (
            datetime.combine(datetime.fromisoformat(text).date(), time(), UTC) if text else None
        )
    except ValueError:
        raise ValueError("expires_at must be a date (YYYY-MM-DD), or empty for never") from None
    return out


def _changed(request: Request) -> None:
    authenticator = request.app.state.get("authenticator")
    if authenticator is not None:
        authenticator.invalidate()


class KeysController(Controller):
    path = "/keys"

    @get("/")
    async def keys(self, request: Request) -> Response:
        return await self._panel(request)

    @post("/", status_code=200)
    async def create(self, request: Request) -> Response:
        service = keys_of(request.app)
        if service is None:
            return await self._panel(request, error="No key database is configured.", status=409)
        try:
            fields = parse_key_form(await request.form())
            name = fields.pop("name")
            record, plaintext = await service.create(name, **fields)
        except ValueError as exc:
            return await self._panel(request, error=str(exc), status=422)
        secret = {"name": record.name, "key": plaintext, "action": "created"}
        return await self._panel(request, secret=secret)

    @get("/{key_id:str}/edit")
    async def edit(self, request: Request, key_id: FromPath[str]) -> Response:
        service = keys_of(request.app)
        record = await service.get(key_id) if service is not None else None
        if record is None:
            return await self._panel(request, error=f"No API key with id {key_id}.", status=404)
        context = {"key": record, "periods": BUDGET_PERIODS}
        return page(request, "key_edit.html", "_key_edit.html", context)

    @post("/{key_id:str}", status_code=200)
    async def update(self, request: Request, key_id: FromPath[str]) -> Response:
        try:
            record = await self._service(request).update(
                key_id, **parse_key_form(await request.form())
            )
        except (ValueError, KeyNotFound) as exc:
            return await self._panel(request, error=str(exc), status=422)
        _changed(request)
        return await self._panel(request, notice=f"Saved {record.name}.", close_editor=True)

    @post("/{key_id:str}/rotate", status_code=200)
    async def rotate(self, request: Request, key_id: FromPath[str]) -> Response:
        form = await request.form()
        try:
            text = str(form.get("grace_seconds") or DEFAULT_ROTATE_GRACE)
            try:
                grace = float(text)
            except ValueError:
                raise ValueError("grace_seconds must be a number of seconds") from None
            record, plaintext = await self._service(request).rotate(key_id, grace_seconds=grace)
        except (ValueError, KeyNotFound) as exc:
            return await self._panel(request, error=str(exc), status=422)
        _changed(request)
        secret = {"name": record.name, "key": plaintext, "action": "rotated", "grace": grace}
        return await self._panel(request, secret=secret)

    @post("/{key_id:str}/revoke", status_code=200)
    async def revoke(self, request: Request, key_id: FromPath[str]) -> Response:
        try:
            record = await self._service(request).revoke(key_id)
        except (ValueError, KeyNotFound) as exc:
            return await self._panel(request, error=str(exc), status=422)
        _changed(request)
        return await self._panel(request, notice=f"Revoked {record.name}.")

    def _service(self, request: Request) -> Any:
        service = keys_of(request.app)
        if service is None:
            raise ValueError("No key database is configured.")
        return service

    async def _panel(
        self,
        request: Request,
        *,
        secret: dict[str, Any] | None = None,
        notice: str | None = None,
        error: str | None = None,
        status: int = 200,
        close_editor: bool = False,
    ) -> Response:
        service = keys_of(request.app)
        records = await service.list() if service is not None else []
        context = {
            "keys": records,
            "has_db": service is not None,
            "secret": secret,
            "notice": notice,
            "error": error,
            "periods": BUDGET_PERIODS,
            "now": datetime.now(UTC),
            "close_editor": close_editor and is_htmx(request),
        }
        return page(request, "keys.html", "_keys.html", context, status_code=status)
