"""`tessera keys ...` and `tessera db ...`: argparse builders and their handlers.

    tessera keys create NAME [--allowed-models a,b] [--rpm N] [--tpm N] [--max-parallel N]
                             [--token-budget N] [--budget-period day|month|total]
                             [--priority N] [--expires-at ISO | --expires-in-days D]
                             [--metadata JSON] [--tenant ID] [--max-request-seconds S]
                             [--json]
    tessera keys list [--active] [--tenant ID] [--json]
    tessera keys revoke ID [ID ...]
    tessera keys rotate ID [--grace-seconds S] [--json]
    tessera db upgrade | current | check

Every command takes --database-url (env TESSERA_DATABASE_URL; default
sqlite+aiosqlite:///<data dir>/tessera.db) and --data-dir (env TESSERA_DATA_DIR; default
$XDG_DATA_HOME/tessera, i.e. ~/.local/share/tessera). `keys` commands migrate a SQLite
database first and refuse an un-migrated Postgres, naming `tessera db upgrade`.

The CLI module wires them in with:

    sub = parser.add_subparsers(dest="command")
    add_subcommands(sub)            # adds "keys", "tenants" (api/cli_tenants.py) and "db"
    args = parser.parse_args()
    return args.handler(args)       # (also set as args.func) exit status: 0 ok, 1 failure, 2 bad input
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TextIO

import msgspec
from sqlalchemy.exc import SQLAlchemyError

from api.db.migrate import head_revisions, schema_drift
from api.db.session import Database, SchemaOutOfDate, default_database_url, redact
from api.schemas.admin import key_info
from api.services.keys import BUDGET_PERIODS, KeyNotFound, KeyRecord, KeyService
from api.services.tenants import TenantNotFound


def default_data_dir() -> Path:
    if env := os.environ.get("TESSERA_DATA_DIR"):
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "tessera"


def resolve_database_url(database_url: str | None, data_dir: str | Path | None) -> str:
    """--database-url, else TESSERA_DATABASE_URL, else SQLite in the data dir."""
    url = database_url or os.environ.get("TESSERA_DATABASE_URL")
    if url:
        return url
    return default_database_url(Path(data_dir) if data_dir else default_data_dir())


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        help="sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER:PASS@HOST/DB "
        "[env TESSERA_DATABASE_URL; default SQLite in the data dir]",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder of the default SQLite database [env TESSERA_DATA_DIR; "
        "default ~/.local/share/tessera]",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def _datetime(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an ISO 8601 date or date-time such as 2030-01-31T12:00:00Z, got {text!r}"
        ) from None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--metadata is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('--metadata must be a JSON object, e.g. \'{"team": "a"}\'')
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _models(text: str) -> list[str]:
    return [m.strip() for m in text.split(",") if m.strip()]


def add_keys_parser(subparsers: Any) -> argparse.ArgumentParser:
    keys = subparsers.add_parser("keys", help="create, list, rotate and revoke API keys")
    actions = keys.add_subparsers(dest="keys_command", metavar="{create,list,revoke,rotate}")
    actions.required = True

    create = actions.add_parser("create", help="issue a new API key (printed once)")
    create.add_argument("name", help="a label for the key's owner")
    create.add_argument(
        "--allowed-models", type=_models, default=None, help="comma-separated (default: all)"
    )
    create.add_argument("--rpm", dest="rpm_limit", type=_positive, help="requests per minute")
    create.add_argument("--tpm", dest="tpm_limit", type=_positive, help="tokens per minute")
    create.add_argument("--max-parallel", type=_positive, help="requests at the same time")
    create.add_argument("--token-budget", type=_positive, help="tokens per budget period")
    create.add_argument("--budget-period", choices=BUDGET_PERIODS, default="total")
    create.add_argument("--priority", type=int, default=0, help="lower runs first (default 0)")
    expiry = create.add_mutually_exclusive_group()
    expiry.add_argument("--expires-at", type=_datetime, help="ISO 8601 (UTC if no offset)")
    expiry.add_argument("--expires-in-days", type=float, help="expire this many days from now")
    create.add_argument("--metadata", type=_json_object, default=None, help="a JSON object")
    create.add_argument(
        "--tenant", dest="tenant_id", default=None, help="tenant id (default: one of its own)"
    )
    create.add_argument(
        "--max-request-seconds", type=_seconds, default=None, help="longest a request may run"
    )
    create.add_argument("--json", action="store_true", help="print the key as JSON")

    listing = actions.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--active", action="store_true", help="hide revoked keys")
    listing.add_argument("--tenant", dest="tenant_id", default=None, help="only this tenant's")
    listing.add_argument("--json", action="store_true", help="print JSON")

    revoke = actions.add_parser("revoke", help="revoke keys by id")
    revoke.add_argument("ids", nargs="+", metavar="ID")

    rotate = actions.add_parser("rotate", help="replace a key's secret (printed once)")
    rotate.add_argument("id", metavar="ID")
    rotate.add_argument(
        "--grace-seconds",
        type=float,
        default=3600,
        help="how long the old secret keeps working (default 3600)",
    )
    rotate.add_argument("--json", action="store_true", help="print the key as JSON")

    for sub in (create, listing, revoke, rotate):
        _common(sub)
    keys.set_defaults(handler=run_keys, func=run_keys)
    return keys


def add_db_parser(subparsers: Any) -> argparse.ArgumentParser:
    db = subparsers.add_parser("db", help="database schema migrations")
    actions = db.add_subparsers(dest="db_command", metavar="{upgrade,current,check}")
    actions.required = True
    for name, text in (
        ("upgrade", "apply pending migrations"),
        ("current", "print the database's schema revision"),
        ("check", "exit 1 unless the schema is at the latest revision without drift"),
    ):
        _common(actions.add_parser(name, help=text))
    db.set_defaults(handler=run_db, func=run_db)
    return db


def add_subcommands(subparsers: Any) -> None:
    from api.cli_tenants import add_tenants_parser  # it builds on this module's helpers

    add_keys_parser(subparsers)
    add_tenants_parser(subparsers)
    add_db_parser(subparsers)


# -- handlers ---------------------------------------------------------------------------


def run_keys(args: argparse.Namespace, out: TextIO | None = None) -> int:
    handlers: dict[str, Callable[[KeyService, argparse.Namespace, TextIO], Awaitable[None]]] = {
        "create": _keys_create,
        "list": _keys_list,
        "revoke": _keys_revoke,
        "rotate": _keys_rotate,
    }
    handler = handlers[args.keys_command]

    async def run(db: Database, stream: TextIO) -> None:
        await db.ensure_schema()
        await handler(KeyService(db), args, stream)

    return _run(args, run, out)


def run_db(args: argparse.Namespace, out: TextIO | None = None) -> int:
    handlers = {"upgrade": _db_upgrade, "current": _db_current, "check": _db_check}
    return _run(args, handlers[args.db_command], out)


class _Failed(Exception):
    """A command failed for a reason already explained to the user."""


def _run(
    args: argparse.Namespace,
    body: Callable[[Database, TextIO], Awaitable[None]],
    out: TextIO | None,
) -> int:
    stream = out or sys.stdout
    try:
        db = Database.from_url(resolve_database_url(args.database_url, args.data_dir))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        try:
            await body(db, stream)
        finally:
            await db.dispose()

    try:
        asyncio.run(main())
    except (ValueError, KeyNotFound, TenantNotFound) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except SchemaOutOfDate as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except _Failed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"error: cannot reach the database {redact(db.url)}: {exc}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        print(f"error: database {redact(db.url)}: {cause}", file=sys.stderr)
        return 1
    return 0


def _info(record: KeyRecord) -> dict[str, Any]:
    return msgspec.to_builtins(key_info(record))


def _print_secret(record: KeyRecord, plaintext: str, as_json: bool, out: TextIO, verb: str) -> None:
    if as_json:
        print(json.dumps({**_info(record), "key": plaintext}, indent=2), file=out)
        return
    print(f"{verb} API key {record.name!r} (id {record.id}).", file=out)
    print("Store it now; it is not shown again:", file=out)
    print(plaintext, file=out)


async def _keys_create(keys: KeyService, args: argparse.Namespace, out: TextIO) -> None:
    expires = args.expires_at
    if args.expires_in_days is not None:
        if args.expires_in_days <= 0:
            raise ValueError("--expires-in-days must be positive")
        expires = datetime.now(UTC) + timedelta(days=args.expires_in_days)
    record, plaintext = await keys.create(
        args.name,
        allowed_models=args.allowed_models,
        rpm_limit=args.rpm_limit,
        tpm_limit=args.tpm_limit,
        max_parallel=args.max_parallel,
        token_budget=args.token_budget,
        budget_period=args.budget_period,
        priority=args.priority,
        expires_at=expires,
        metadata=args.metadata,
        tenant_id=args.tenant_id,
        max_request_seconds=args.max_request_seconds,
    )
    _print_secret(record, plaintext, args.json, out, "Created")


async def _keys_rotate(keys: KeyService, args: argparse.Namespace, out: TextIO) -> None:
    record, plaintext = await keys.rotate(args.id, grace_seconds=args.grace_seconds)
    _print_secret(record, plaintext, args.json, out, "Rotated")


async def _keys_revoke(keys: KeyService, args: argparse.Namespace, out: TextIO) -> None:
    for key_id in args.ids:
        record = await keys.revoke(key_id)
        print(f"Revoked {record.id} ({record.name}).", file=out)


def _limits(r: KeyRecord) -> str:
    parts = [
        f"{label}={value}"
        for label, value in (
            ("rpm", r.rpm_limit),
            ("tpm", r.tpm_limit),
            ("parallel", r.max_parallel),
            (f"budget/{r.budget_period}", r.token_budget),
        )
        if value is not None
    ]
    return " ".join(parts) or "unlimited"


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


async def _keys_list(keys: KeyService, args: argparse.Namespace, out: TextIO) -> None:
    records = await keys.list(include_revoked=not args.active, tenant_id=args.tenant_id)
    if args.json:
        print(json.dumps([_info(r) for r in records], indent=2), file=out)
        return
    if not records:
        print("No API keys. Create one with `tessera keys create NAME`.", file=out)
        return
    rows = [("ID", "NAME", "TENANT", "PREFIX", "CREATED", "EXPIRES", "REVOKED", "LIMITS")]
    rows += [
        (
            r.id,
            r.name,
            r.tenant.name if r.tenant is not None else r.tenant_id,
            r.key_prefix + "…",
            _when(r.created_at),
            _when(r.expires_at),
            _when(r.revoked_at),
            _limits(r),
        )
        for r in records
    ]
    print_table(rows, out)


def print_table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out
        )


async def _db_upgrade(db: Database, out: TextIO) -> None:
    before = await db.current_revision()
    await db.upgrade()
    after = await db.current_revision()
    what = "already at" if before == after else "upgraded to"
    print(f"{redact(db.url)}: {what} revision {', '.join(after)}", file=out)


async def _db_current(db: Database, out: TextIO) -> None:
    current = await db.current_revision()
    head = head_revisions()
    state = "head" if set(current) == set(head) else f"latest is {', '.join(head)}"
    print(f"{', '.join(current) or '(empty: no migrations applied)'} ({state})", file=out)


async def _db_check(db: Database, out: TextIO) -> None:
    if not await db.is_up_to_date():
        current = ", ".join(await db.current_revision()) or "empty"
        raise _Failed(
            f"{redact(db.url)} is at revision {current}, not {', '.join(head_revisions())}: "
            f"run `tessera db upgrade --database-url {redact(db.url)}`"
        )
    async with db.engine.connect() as conn:
        drift = await conn.run_sync(schema_drift)
    if drift:
        raise _Failed(f"the schema differs from the models: {drift}")
    print(f"{redact(db.url)}: up to date", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
