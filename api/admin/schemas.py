"""The admin REST wire format (/admin/v1), as msgspec Structs.

Other tools are written against these shapes; change them only compatibly. Limits are
positive integers or null (= unlimited). Times are RFC 3339 date-times in UTC.

The limits a key and a tenant share are written once per role: `CreateLimits`, `UpdateLimits`
and `InfoLimits`. They are keyword-only, and msgspec orders a keyword-only field after the
others (in the JSON and the OpenAPI schema): so each shape is a head over its limits (the
fields before them) and a keyword-only class over that head (the fields after), and its
fields keep the order the wire format always had.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

import msgspec

from api.keys.service import KeyRecord, UsageBucket
from api.tenants.service import TenantRecord

Limit = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
BigLimit = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
ModelName = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Priority = Annotated[int, msgspec.Meta(ge=-1000, le=1000)]
BudgetPeriod = Literal["day", "month", "total"]
Seconds = Annotated[float, msgspec.Meta(gt=0, le=7 * 86400)]
Weight = Annotated[float, msgspec.Meta(gt=0, le=1000)]
CacheScope = Literal["key", "tenant"]
TenantId = Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
UNSET = msgspec.UNSET


class CreateLimits(msgspec.Struct, kw_only=True):
    """A create body's limits, key and tenant alike."""

    rpm_limit: Limit | None = None
    tpm_limit: BigLimit | None = None
    max_parallel: Limit | None = None
    token_budget: BigLimit | None = None
    budget_period: BudgetPeriod = "total"


class UpdateLimits(msgspec.Struct, kw_only=True):
    """A PATCH body's limits: only the fields present change; an explicit null means
    unlimited."""

    rpm_limit: Limit | None | msgspec.UnsetType = UNSET
    tpm_limit: BigLimit | None | msgspec.UnsetType = UNSET
    max_parallel: Limit | None | msgspec.UnsetType = UNSET
    token_budget: BigLimit | None | msgspec.UnsetType = UNSET
    budget_period: BudgetPeriod | msgspec.UnsetType = UNSET

    def changes(self) -> dict[str, Any]:
        """The fields the body sets (all of the shape's, not only the limits)."""
        return {
            f: getattr(self, f)
            for f in self.__struct_fields__
            if getattr(self, f) is not msgspec.UNSET
        }


class InfoLimits(msgspec.Struct, kw_only=True):
    """A key's or a tenant's limits as a response shows them."""

    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel: int | None
    token_budget: int | None
    budget_period: str
    budget_used: int


def info_limits(record: Any) -> dict[str, Any]:
    """A KeyRecord's or TenantRecord's InfoLimits fields."""
    return {f: getattr(record, f) for f in InfoLimits.__struct_fields__}


class _KeyCreateHead(CreateLimits):
    name: Name
    allowed_models: list[ModelName] | None = None


class KeyCreate(_KeyCreateHead, kw_only=True, forbid_unknown_fields=True):
    priority: Priority = 0
    expires_at: datetime | None = None
    metadata: dict[str, Any] | None = None
    tenant_id: TenantId | None = None  # None: a tenant of the key's own
    max_request_seconds: Seconds | None = None

    def __post_init__(self) -> None:
        _check_expiry(self.expires_at)


def _check_expiry(expires_at: Any) -> None:
    """Bodies are decoded leniently (a number or a numeric string is read as Unix seconds):
    `"expires_at": 0.5` would be a key that expired in 1970. A time before 2000 is a mistake."""
    if isinstance(expires_at, datetime) and expires_at.year < 2000:
        raise ValueError(
            "expires_at must be an RFC 3339 date-time (e.g. 2026-01-01T00:00:00Z) from 2000 on"
        )


class _KeyUpdateHead(UpdateLimits):
    name: Name | msgspec.UnsetType = UNSET
    allowed_models: list[ModelName] | None | msgspec.UnsetType = UNSET


class KeyUpdate(_KeyUpdateHead, kw_only=True, forbid_unknown_fields=True):
    """PATCH body: only the fields present change; an explicit null means unlimited."""

    priority: Priority | msgspec.UnsetType = UNSET
    expires_at: datetime | None | msgspec.UnsetType = UNSET
    metadata: dict[str, Any] | None | msgspec.UnsetType = UNSET
    tenant_id: TenantId | msgspec.UnsetType = UNSET
    max_request_seconds: Seconds | None | msgspec.UnsetType = UNSET

    def __post_init__(self) -> None:
        _check_expiry(self.expires_at)


class _TenantCreateHead(CreateLimits):
    name: Name
    weight: Weight = 1.0


class TenantCreate(_TenantCreateHead, kw_only=True, forbid_unknown_fields=True):
    prefix_cache_scope: CacheScope = "key"
    max_request_seconds: Seconds | None = None


class _TenantUpdateHead(UpdateLimits):
    name: Name | msgspec.UnsetType = UNSET
    weight: Weight | msgspec.UnsetType = UNSET


class TenantUpdate(_TenantUpdateHead, kw_only=True, forbid_unknown_fields=True):
    """PATCH body: only the fields present change; an explicit null means unlimited."""

    prefix_cache_scope: CacheScope | msgspec.UnsetType = UNSET
    max_request_seconds: Seconds | None | msgspec.UnsetType = UNSET
    disabled: bool | msgspec.UnsetType = UNSET


class _TenantInfoHead(InfoLimits):
    id: str
    object: str
    name: str
    weight: float


class TenantInfo(_TenantInfoHead, kw_only=True):
    prefix_cache_scope: str
    max_request_seconds: float | None
    created_at: datetime
    disabled_at: datetime | None
    keys: int


class TenantList(msgspec.Struct):
    data: list[TenantInfo]
    object: str = "list"


def tenant_info(r: TenantRecord) -> TenantInfo:
    return TenantInfo(
        **info_limits(r),
        id=r.id,
        object="tenant",
        name=r.name,
        weight=r.weight,
        prefix_cache_scope=r.prefix_cache_scope,
        max_request_seconds=r.max_request_seconds,
        created_at=r.created_at,
        disabled_at=r.disabled_at,
        keys=r.keys,
    )


class KeyRotate(msgspec.Struct, forbid_unknown_fields=True):
    # How long the old secret keeps working, in seconds (0 = stop at once; max 30 days).
    grace_seconds: Annotated[int, msgspec.Meta(ge=0, le=30 * 86400)] = 3600


# --- times in query strings (GET /admin/v1/usage?since=&until=) -----------------------------

# Unix seconds are taken between these (2000-01-01 and 2100-01-01 UTC): a number outside is a
# mistake (0.5, a count of days, milliseconds), not a time anyone means.
EARLIEST_UNIX_S = 946_684_800
LATEST_UNIX_S = 4_102_444_800
TIME_QUERY_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "format": "date-time", "description": "RFC 3339, with Z or an offset"},
        {
            "type": "number",
            "minimum": EARLIEST_UNIX_S,
            "maximum": LATEST_UNIX_S,
            "description": "Unix seconds (2000 to 2100)",
        },
    ]
}
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d{1,9})?([Zz]|[+-]\d{2}:\d{2})")
_UNIX = re.compile(r"\d{1,16}(\.\d{1,9})?")


def parse_time(value: str, param: str) -> datetime:
    """A query string's time: an RFC 3339 date-time with a UTC offset, or Unix seconds from
    2000 to 2100; ValueError (naming `param`, for a 400) for anything else."""
    value = value.strip()
    if _RFC3339.fullmatch(value):
        try:
            return datetime.fromisoformat(value.upper().replace("Z", "+00:00")).astimezone(UTC)
        except ValueError:
            pass  # 2025-02-30, 25:00, a leap second: fall through to the message
    elif _UNIX.fullmatch(value):
        seconds = float(value)
        if EARLIEST_UNIX_S <= seconds <= LATEST_UNIX_S:
            return datetime.fromtimestamp(seconds, UTC)
        if EARLIEST_UNIX_S * 1000 <= seconds <= LATEST_UNIX_S * 1000:
            raise ValueError(
                f"{param} looks like Unix milliseconds ({value}); send seconds, or an RFC 3339 "
                "date-time such as 2025-06-01T00:00:00Z."
            )
    shown = value if len(value) <= 40 else value[:39] + "…"
    raise ValueError(
        f"{param} must be an RFC 3339 date-time with a UTC offset (e.g. 2025-06-01T00:00:00Z) "
        f"or Unix seconds between {EARLIEST_UNIX_S} (2000) and {LATEST_UNIX_S} (2100); "
        f"got {shown!r}."
    )


class _KeyInfoHead(InfoLimits):
    id: str
    object: str
    name: str
    key_prefix: str
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None
    allowed_models: list[str] | None


class KeyInfo(_KeyInfoHead, kw_only=True):
    priority: int
    metadata: dict[str, Any]
    previous_key_valid_until: datetime | None
    tenant_id: str
    max_request_seconds: float | None


class KeyWithSecret(KeyInfo, kw_only=True):
    """Returned by create and rotate: the only responses that carry the key itself."""

    key: str = ""


class KeyList(msgspec.Struct):
    data: list[KeyInfo]
    object: str = "list"


class UsageItem(msgspec.Struct):
    key_id: str | None
    key_name: str | None
    period_start: datetime
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    total_tokens: int


class UsageReport(msgspec.Struct):
    group_by: str
    since: datetime | None
    until: datetime | None
    data: list[UsageItem]
    object: str = "list"


def key_info(record: KeyRecord) -> KeyInfo:
    return KeyInfo(**_key_fields(record))


def key_with_secret(record: KeyRecord, key: str) -> KeyWithSecret:
    return KeyWithSecret(**_key_fields(record), key=key)


def _key_fields(r: KeyRecord) -> dict[str, Any]:
    return {
        **info_limits(r),
        "id": r.id,
        "object": "api_key",
        "name": r.name,
        "key_prefix": r.key_prefix,
        "created_at": r.created_at,
        "expires_at": r.expires_at,
        "revoked_at": r.revoked_at,
        "allowed_models": list(r.allowed_models) if r.allowed_models is not None else None,
        "priority": r.priority,
        "metadata": r.metadata,
        "previous_key_valid_until": r.previous_valid_until,
        "tenant_id": r.tenant_id,
        "max_request_seconds": r.max_request_seconds,
    }


def usage_item(b: UsageBucket) -> UsageItem:
    return UsageItem(
        key_id=b.key_id,
        key_name=b.key_name,
        period_start=b.period_start,
        requests=b.requests,
        errors=b.errors,
        prompt_tokens=b.prompt_tokens,
        completion_tokens=b.completion_tokens,
        cached_tokens=b.cached_tokens,
        total_tokens=b.total_tokens,
    )


# --- LoRA adapters (api/admin/lora.py): vLLM's load / unload bodies, plus the owner ---


class LoRAAdapterLoad(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str
    lora_path: str
    # The owning tenant: only its keys may call the adapter. None: every key (public).
    tenant_id: str | None = None


class LoRAAdapterUnload(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    lora_name: str


class LoRAAdapterInfo(msgspec.Struct, kw_only=True):
    name: str
    path: str
    tenant_id: str | None  # None: public
    source: str  # "flag" (--lora-modules) or "admin" (loaded through this API; kept in the DB)
    created: int
    running: int  # requests in flight with it


class LoRAAdapterList(msgspec.Struct):
    data: list[LoRAAdapterInfo]
    object: Literal["list"] = "list"
