"""What the `tessera keys`, `tenants` and `db` commands share: the database options, the limit
options, argument types, running a command against the database (exit status 0 ok, 1 failure,
2 bad input) or one of a service's actions (run_service) and printing a table or JSON."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TextIO, TypeVar

import msgspec
from sqlalchemy.exc import SQLAlchemyError

from api.db.session import Database, SchemaOutOfDate, redact, resolve_database_url
from api.keys.fields import BUDGET_PERIODS, Limits
from api.keys.service import KeyNotFound
from api.tenants.service import TenantNotFound

Service = TypeVar("Service")
R = TypeVar("R")
_UNLIMITED = ("none", "null", "unlimited")


def database_options(parser: argparse.ArgumentParser) -> None:
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


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, or None for "none" / "null" / "unlimited" (an update lifting a limit)."""

    def parser(text: str) -> Any:
        return None if text.lower() in _UNLIMITED else parse(text)

    parser.__name__ = getattr(parse, "__name__", "value")
    return parser


# The limit options a key and a tenant share: flag, destination, help.
_LIMIT_OPTIONS = (
    ("--rpm", "rpm_limit", "requests per minute"),
    ("--tpm", "tpm_limit", "tokens per minute"),
    ("--max-parallel", "max_parallel", "requests at the same time"),
    ("--token-budget", "token_budget", "tokens per budget period"),
)


def limit_options(
    parser: argparse.ArgumentParser, *, update: bool = False, described: bool = True
) -> None:
    """--rpm, --tpm, --max-parallel, --token-budget and --budget-period. On update an option
    left out changes nothing (SUPPRESS) and "none" lifts a limit. `described`: with help
    texts (`keys create` has them, `tenants` never had)."""
    default = argparse.SUPPRESS if update else None
    parse = or_none(positive) if update else positive
    for flag, dest, text in _LIMIT_OPTIONS:
        parser.add_argument(
            flag, dest=dest, type=parse, default=default, help=text if described else None
        )
    parser.add_argument(
        "--budget-period", choices=BUDGET_PERIODS, default=default if update else "total"
    )


def max_request_seconds_option(
    parser: argparse.ArgumentParser, *, update: bool = False, described: bool = True
) -> None:
    parser.add_argument(
        "--max-request-seconds",
        type=or_none(seconds) if update else seconds,
        default=argparse.SUPPRESS if update else None,
        help="longest a request may run" if described else None,
    )


class Failed(Exception):
    """A command failed for a reason already explained to the user."""


def run_with_database(
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
    except Failed as exc:
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


def run_service(
    args: argparse.Namespace,
    service: Callable[[Database], Service],
    action: Callable[[Service, argparse.Namespace, TextIO], Awaitable[None]],
    out: TextIO | None,
) -> int:
    """One action of a `keys` or `tenants` command: the schema made ready (a SQLite database
    migrated, an un-migrated Postgres refused), then `action(service(db), args, out)`."""

    async def run(db: Database, stream: TextIO) -> None:
        await db.ensure_schema()
        await action(service(db), args, stream)

    return run_with_database(args, run, out)


def print_json(value: Any, out: TextIO) -> None:
    """A wire shape (api/admin/schemas.py) or a list of them, as the CLI's --json prints it."""
    print(json.dumps(msgspec.to_builtins(value), indent=2), file=out)


async def for_each_id(
    ids: Sequence[str], action: Callable[[str], Awaitable[Any]], verb: str, out: TextIO
) -> None:
    """`action` on each id in turn (revoke, disable), each confirmed with a line: the first
    unknown id stops there (exit status 2)."""
    for item_id in ids:
        record = await action(item_id)
        print(f"{verb} {record.id} ({record.name}).", file=out)


def print_listing(
    records: Sequence[R],
    as_json: bool,
    out: TextIO,
    *,
    info: Callable[[R], Any],
    empty: str,
    header: tuple[str, ...],
    row: Callable[[R], tuple[str, ...]],
) -> None:
    """A `list` command's output: the records' wire shapes as JSON, `empty` when there are
    none, else a table."""
    if as_json:
        print_json([info(r) for r in records], out)
    elif not records:
        print(empty, file=out)
    else:
        print_table([header, *(row(r) for r in records)], out)


def limits(r: Limits) -> str:
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


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def print_table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out
        )
