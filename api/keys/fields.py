"""API key and tenant settings: what a caller may set, its validation and budget periods.

validate_fields() (keys) and validate_tenant_fields() (tenants) are shared by the admin API,
the CLI and the services: they raise ValueError with a message a user can act on, and
return the settings normalised. The limits a key and a tenant both have (LIMIT_FIELDS) are
written once here: their defaults, their checks, and `Limits`, the base of both records.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

BUDGET_PERIODS = ("day", "month", "total")
MAX_METADATA_BYTES = 16 * 1024
MAX_PRIORITY = 1000
MAX_WEIGHT = 1000.0
MAX_REQUEST_SECONDS = 7 * 86400
PREFIX_CACHE_SCOPES = ("key", "tenant")
_INT32 = 2**31 - 1
_INT63 = 2**63 - 1

# The limits a key and a tenant both have (None: unlimited), with their defaults. A tenant's
# apply to the sum of its keys' requests on top of each key's own (the tighter wins).
LIMIT_FIELDS: dict[str, Any] = {
    "rpm_limit": None,
    "tpm_limit": None,
    "max_parallel": None,
    "token_budget": None,
    "budget_period": "total",
    "max_request_seconds": None,
}

# Fields a caller may set on create/update, with their defaults.
KEY_FIELDS: dict[str, Any] = {
    "allowed_models": None,
    **LIMIT_FIELDS,
    "priority": 0,
    "expires_at": None,
    "metadata": None,
    "tenant_id": None,  # None on create: a tenant of the key's own
}

# Fields a caller may set on a tenant, with their defaults.
TENANT_FIELDS: dict[str, Any] = {"weight": 1.0, **LIMIT_FIELDS, "prefix_cache_scope": "key"}


@dataclass(slots=True, frozen=True, kw_only=True)
class Limits:
    """The limits of a key's or a tenant's record (KeyRecord, TenantRecord)."""

    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel: int | None
    token_budget: int | None
    budget_period: str
    budget_used: int  # reserved + used tokens in the current budget period
    max_request_seconds: float | None = None

    @property
    def has_limits(self) -> bool:
        return has_limits(self)


def has_limits(x: Any) -> bool:
    """Whether a record or principal has a rate, parallel or budget limit (quotas count it)."""
    return any(v is not None for v in (x.rpm_limit, x.tpm_limit, x.max_parallel, x.token_budget))


def limits_of(row: Any, now: datetime) -> dict[str, Any]:
    """A key's or a tenant's row's limits, as Limits takes them: the budget used counts only
    while the period it was counted in is the current one."""
    current = row.budget_period_start == period_start(row.budget_period, now)
    return {
        **{field: getattr(row, field) for field in LIMIT_FIELDS},
        "budget_used": row.budget_used if current else 0,
    }


def _limit(field: str, value: Any, maximum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ValueError(f"{field} must be a whole number from 1 to {maximum}, or null (unlimited)")
    return value


def validate_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip() or len(name.strip()) > 200:
        raise ValueError("name must be a non-empty string of at most 200 characters")
    return name.strip()


def validate_fields(changes: dict[str, Any]) -> dict[str, Any]:
    """Check key settings; returns them normalised. Unknown fields are an error."""
    unknown = sorted(set(changes) - set(KEY_FIELDS) - {"name"})
    if unknown:
        raise ValueError(f"unknown key field(s): {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for field, value in changes.items():
        if field == "name":
            out[field] = validate_name(value)
        elif field == "allowed_models":
            out[field] = _models(value)
        elif field in LIMIT_FIELDS:
            out[field] = _check_limit(field, value)
        elif field == "priority":
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_PRIORITY:
                raise ValueError(
                    f"priority must be a whole number from -{MAX_PRIORITY} to {MAX_PRIORITY} "
                    "(lower runs first)"
                )
            out[field] = value
        elif field == "expires_at":
            if value is not None and not isinstance(value, datetime):
                raise ValueError("expires_at must be an ISO 8601 date-time or null")
            out[field] = aware(value) if value is not None else None
        elif field == "metadata":
            out[field] = _metadata(value)
        elif field == "tenant_id":
            if value is not None and (not isinstance(value, str) or not 1 <= len(value) <= 32):
                raise ValueError("tenant_id must be a tenant's id")
            out[field] = value
    return out


def validate_tenant_fields(changes: dict[str, Any]) -> dict[str, Any]:
    """Check tenant settings; returns them normalised. Unknown fields are an error."""
    unknown = sorted(set(changes) - set(TENANT_FIELDS) - {"name", "disabled"})
    if unknown:
        raise ValueError(f"unknown tenant field(s): {', '.join(unknown)}")
    out: dict[str, Any] = {}
    for field, value in changes.items():
        if field == "weight":
            if (
                isinstance(value, bool)
                or not isinstance(value, int | float)
                or not math.isfinite(value)
                or not 0 < value <= MAX_WEIGHT
            ):
                raise ValueError(f"weight must be a number above 0 and at most {MAX_WEIGHT:g}")
            out[field] = float(value)
        elif field == "prefix_cache_scope":
            if value not in PREFIX_CACHE_SCOPES:
                raise ValueError("prefix_cache_scope must be `key` or `tenant`")
            out[field] = value
        elif field == "disabled":
            if not isinstance(value, bool):
                raise ValueError("disabled must be true or false")
            out[field] = value
        elif field == "name":
            out[field] = validate_name(value)
        elif field in LIMIT_FIELDS:
            out[field] = _check_limit(field, value)
    return out


def _check_limit(field: str, value: Any) -> Any:
    """One of LIMIT_FIELDS, checked and normalised."""
    if field in ("rpm_limit", "max_parallel"):
        return _limit(field, value, _INT32)
    if field in ("tpm_limit", "token_budget"):
        return _limit(field, value, _INT63)
    if field == "budget_period":
        if value not in BUDGET_PERIODS:
            raise ValueError(f"budget_period must be one of {', '.join(BUDGET_PERIODS)}")
        return value
    return _duration(value)


def _duration(value: Any) -> float | None:
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= MAX_REQUEST_SECONDS
    ):
        raise ValueError(
            f"max_request_seconds must be a number of seconds above 0 and at most "
            f"{MAX_REQUEST_SECONDS}, or null (no limit)"
        )
    return float(value)


def aware(value: datetime) -> datetime:
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _models(value: Any) -> list[str] | None:
    if value is None:
        return None
    if not isinstance(value, list | tuple) or len(value) > 1000:
        raise ValueError("allowed_models must be a list of model names (at most 1000) or null")
    names: list[str] = []
    for name in value:
        if not isinstance(name, str) or not name or len(name) > 200:
            raise ValueError("each allowed model must be a non-empty string (<= 200 chars)")
        if name not in names:
            names.append(name)
    return names


def _metadata(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError("metadata must be a JSON object or null")
    try:
        encoded = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        raise ValueError("metadata must be JSON-serialisable (no NaN or infinity)") from None
    if len(encoded.encode()) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata must be at most {MAX_METADATA_BYTES} bytes as JSON")
    return value


def period_start(period: str, now: datetime) -> float:
    """Epoch seconds at which the budget period containing `now` (UTC) began."""
    now = now.astimezone(UTC)
    if period == "day":
        return now.replace(hour=0, minute=0, second=0, microsecond=0).timestamp()
    if period == "month":
        return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0).timestamp()
    return 0.0


def next_period_start(period: str, now: datetime) -> float | None:
    start = datetime.fromtimestamp(period_start(period, now), UTC)
    if period == "day":
        return (start + timedelta(days=1)).timestamp()
    if period == "month":
        year, month = (start.year + 1, 1) if start.month == 12 else (start.year, start.month + 1)
        return start.replace(year=year, month=month).timestamp()
    return None
