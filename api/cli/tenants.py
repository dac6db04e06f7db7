"""`tessera tenants ...`: tenants (teams of keys) on the command line.

    tessera tenants create NAME [--weight W] [--rpm N] [--tpm N] [--max-parallel N]
                               [--token-budget N] [--budget-period day|month|total]
                               [--prefix-cache-scope key|tenant] [--max-request-seconds S]
                               [--json]
    tessera tenants list [--active] [--json]
    tessera tenants update ID [--name NAME] [--weight W] [--rpm N|none] [--tpm N|none]
                              [--max-parallel N|none] [--token-budget N|none]
                              [--budget-period P] [--prefix-cache-scope S]
                              [--max-request-seconds S|none] [--enable] [--json]
    tessera tenants delete ID [ID ...]        # disables: its keys are refused (401)

Keys join a tenant with `tessera keys create NAME --tenant ID`. Same --database-url /
--data-dir as `tessera keys` (api/cli/db.py), same exit codes (0 ok, 1 failure, 2 bad input).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Awaitable, Callable
from typing import Any, TextIO

import msgspec

from api.admin.schemas import tenant_info
from api.cli.common import (
    database_options,
    limits,
    positive,
    print_table,
    run_with_database,
    seconds,
    when,
)
from api.db.session import Database
from api.keys.fields import BUDGET_PERIODS, PREFIX_CACHE_SCOPES
from api.tenants.service import TenantRecord, TenantService

_UNLIMITED = ("none", "null", "unlimited")


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError("the weight must be above 0 and at most 1000")
    return value


def _or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parser(text: str) -> Any:
        return None if text.lower() in _UNLIMITED else parse(text)

    parser.__name__ = getattr(parse, "__name__", "value")
    return parser


def _limit_options(parser: argparse.ArgumentParser, *, update: bool) -> None:
    # On update an option left out changes nothing (SUPPRESS); "none" lifts a limit.
    default = argparse.SUPPRESS if update else None
    wrap = _or_none if update else (lambda p: p)
    parser.add_argument("--weight", type=_weight, default=default if update else 1.0,
                        help="share of the fair scheduler (default 1)")  # fmt: skip
    parser.add_argument("--rpm", dest="rpm_limit", type=wrap(positive), default=default)
    parser.add_argument("--tpm", dest="tpm_limit", type=wrap(positive), default=default)
    parser.add_argument("--max-parallel", type=wrap(positive), default=default)
    parser.add_argument("--token-budget", type=wrap(positive), default=default)
    parser.add_argument(
        "--budget-period", choices=BUDGET_PERIODS, default=default if update else "total"
    )
    parser.add_argument(
        "--prefix-cache-scope",
        choices=PREFIX_CACHE_SCOPES,
        default=default if update else "key",
        help="key: each key's prompts cached apart (default); tenant: shared by its keys",
    )
    parser.add_argument("--max-request-seconds", type=wrap(seconds), default=default)
    parser.add_argument("--json", action="store_true", help="print the tenant as JSON")


def add_tenants_parser(subparsers: Any) -> argparse.ArgumentParser:
    tenants = subparsers.add_parser("tenants", help="create, list, update and delete tenants")
    actions = tenants.add_subparsers(dest="tenants_command", metavar="{create,list,update,delete}")
    actions.required = True

    create = actions.add_parser("create", help="add a tenant")
    create.add_argument("name")
    _limit_options(create, update=False)

    listing = actions.add_parser("list", help="list tenants")
    listing.add_argument("--active", action="store_true", help="hide disabled tenants")
    listing.add_argument("--json", action="store_true", help="print JSON")

    update = actions.add_parser("update", help="change a tenant ('none' lifts a limit)")
    update.add_argument("id", metavar="ID")
    update.add_argument("--name", default=argparse.SUPPRESS)
    update.add_argument(
        "--enable", dest="disabled", action="store_false", default=argparse.SUPPRESS,
        help="re-enable a disabled tenant",
    )  # fmt: skip
    _limit_options(update, update=True)

    delete = actions.add_parser("delete", help="disable tenants (their keys stop working)")
    delete.add_argument("ids", nargs="+", metavar="ID")

    for sub in (create, listing, update, delete):
        database_options(sub)
    tenants.set_defaults(handler=run_tenants, func=run_tenants)
    return tenants


def run_tenants(args: argparse.Namespace, out: TextIO | None = None) -> int:
    handlers: dict[str, Callable[[TenantService, argparse.Namespace, TextIO], Awaitable[None]]]
    handlers = {
        "create": _create,
        "list": _list,
        "update": _update,
        "delete": _delete,
    }
    handler = handlers[args.tenants_command]

    async def run(db: Database, stream: TextIO) -> None:
        await db.ensure_schema()
        await handler(TenantService(db), args, stream)

    return run_with_database(args, run, out)


_SETTINGS = ("weight", "rpm_limit", "tpm_limit", "max_parallel", "token_budget",
             "budget_period", "prefix_cache_scope", "max_request_seconds")  # fmt: skip


def _info(record: TenantRecord) -> dict[str, Any]:
    return msgspec.to_builtins(tenant_info(record))


def _show(record: TenantRecord, as_json: bool, out: TextIO, verb: str) -> None:
    if as_json:
        print(json.dumps(_info(record), indent=2), file=out)
    else:
        print(f"{verb} tenant {record.name!r} (id {record.id}).", file=out)


async def _create(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    record = await tenants.create(args.name, **{f: getattr(args, f) for f in _SETTINGS})
    _show(record, args.json, out, "Created")


async def _update(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    changes = {f: getattr(args, f) for f in (*_SETTINGS, "name", "disabled") if hasattr(args, f)}
    if not changes:
        raise ValueError("nothing to change: pass at least one option (see --help)")
    _show(await tenants.update(args.id, **changes), args.json, out, "Updated")


async def _delete(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    for tenant_id in args.ids:
        record = await tenants.disable(tenant_id)
        print(f"Disabled {record.id} ({record.name}).", file=out)


async def _list(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    records = await tenants.list(include_disabled=not args.active)
    if args.json:
        print(json.dumps([_info(r) for r in records], indent=2), file=out)
        return
    if not records:
        print("No tenants. Create one with `tessera tenants create NAME`.", file=out)
        return
    rows = [("ID", "NAME", "WEIGHT", "KEYS", "CACHE", "DISABLED", "LIMITS")]
    rows += [
        (r.id, r.name, f"{r.weight:g}", str(r.keys), r.prefix_cache_scope, when(r.disabled_at),
         limits(r))  # type: ignore[arg-type]
        for r in records
    ]  # fmt: skip
    print_table(rows, out)
