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
    add_subcommands(sub)            # adds "keys", "tenants" (api/cli/tenants.py) and "db"
    args = parser.parse_args()
    return args.handler(args)       # (also set as args.func) exit status: 0 ok, 1 failure, 2 bad input
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime, timedelta
from typing import Any, TextIO

from api.admin.schemas import key_info, key_with_secret
from api.cli.common import (
    Failed,
    database_options,
    for_each_id,
    limit_options,
    limits,
    max_request_seconds_option,
    print_json,
    print_listing,
    run_service,
    run_with_database,
    when,
)
from api.db.migrate import head_revisions, schema_drift
from api.db.session import Database, redact
from api.keys.service import KeyRecord, KeyService


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
    limit_options(create)
    create.add_argument("--priority", type=int, default=0, help="lower runs first (default 0)")
    expiry = create.add_mutually_exclusive_group()
    expiry.add_argument("--expires-at", type=_datetime, help="ISO 8601 (UTC if no offset)")
    expiry.add_argument("--expires-in-days", type=float, help="expire this many days from now")
    create.add_argument("--metadata", type=_json_object, default=None, help="a JSON object")
    create.add_argument(
        "--tenant", dest="tenant_id", default=None, help="tenant id (default: one of its own)"
    )
    max_request_seconds_option(create)
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
        database_options(sub)
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
        database_options(actions.add_parser(name, help=text))
    db.set_defaults(handler=run_db, func=run_db)
    return db


def add_subcommands(subparsers: Any) -> None:
    from api.cli.tenants import add_tenants_parser  # it builds on this module's helpers

    add_keys_parser(subparsers)
    add_tenants_parser(subparsers)
    add_db_parser(subparsers)


# -- handlers ---------------------------------------------------------------------------


def run_keys(args: argparse.Namespace, out: TextIO | None = None) -> int:
    actions = {
        "create": _keys_create,
        "list": _keys_list,
        "revoke": _keys_revoke,
        "rotate": _keys_rotate,
    }
    return run_service(args, KeyService, actions[args.keys_command], out)


def run_db(args: argparse.Namespace, out: TextIO | None = None) -> int:
    handlers = {"upgrade": _db_upgrade, "current": _db_current, "check": _db_check}
    return run_with_database(args, handlers[args.db_command], out)


def _print_secret(record: KeyRecord, plaintext: str, as_json: bool, out: TextIO, verb: str) -> None:
    if as_json:
        print_json(key_with_secret(record, plaintext), out)
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
    await for_each_id(args.ids, keys.revoke, "Revoked", out)


async def _keys_list(keys: KeyService, args: argparse.Namespace, out: TextIO) -> None:
    print_listing(
        await keys.list(include_revoked=not args.active, tenant_id=args.tenant_id),
        args.json,
        out,
        info=key_info,
        empty="No API keys. Create one with `tessera keys create NAME`.",
        header=("ID", "NAME", "TENANT", "PREFIX", "CREATED", "EXPIRES", "REVOKED", "LIMITS"),
        row=lambda r: (
            r.id,
            r.name,
            r.tenant.name if r.tenant is not None else r.tenant_id,
            r.key_prefix + "…",
            when(r.created_at),
            when(r.expires_at),
            when(r.revoked_at),
            limits(r),
        ),
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
        raise Failed(
            f"{redact(db.url)} is at revision {current}, not {', '.join(head_revisions())}: "
            f"run `tessera db upgrade --database-url {redact(db.url)}`"
        )
    async with db.engine.connect() as conn:
        drift = await conn.run_sync(schema_drift)
    if drift:
        raise Failed(f"the schema differs from the models: {drift}")
    print(f"{redact(db.url)}: up to date", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
