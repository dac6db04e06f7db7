"""The LoRA adapters the server serves, who may call each, and loading / unloading at run time.

    registry = AdapterRegistry(modules, db)         # --lora-modules (public) + the DB table
    await registry.start(engine)                    # folders checked; a bad module: ValueError
    adapter = registry.resolve(model, principal)    # None: the base model; 404 if not visible
    await registry.load(name, path, tenant_id)      # ValueError names the field: nothing kept
    await registry.unload(name)                     # AdapterInUse while requests run it (409)
    await registry.refresh()                        # the table's rows now (every 2 s on its own)
    await registry.stop()                           # the sync loop ends

An adapter is public (every key may call it: the --lora-modules ones, and those loaded without
`tenant_id`) or owned by one tenant: only that tenant's keys see it, in /v1/models and as a
`model`; to the others it answers as an unknown model does (404 model_not_found). Adapters
loaded through the admin API are rows of `lora_adapters` (api/db/models.py), loaded again at
start; a row whose folder no longer fits is logged and not served (unloading it deletes it).
Every SYNC_INTERVAL_S the registry reads the table again, so an adapter loaded or unloaded
through another process sharing the database (another API server of this server,
--api-server-count; a replica) is served or dropped here too.

The engine keys its slots, its CPU cache and its prefix-cache hashes by lora_int_id, so an id
must name one adapter everywhere and never another: the --lora-modules adapters take 1, 2, ...
in flag order (the same in every process), a row of the table a number derived from its name,
folder and creation time (the same in every process that reads it, and new for an adapter
unloaded and loaded again: it never meets the old one's cached blocks or weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, select

from api.db.models import LoRAAdapterRow, Tenant, utcnow
from api.lora.modules import LoRAModule, check_name
from engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from api.db.session import Database
    from api.keys.auth import Principal

log = logging.getLogger("tessera.api")

SYNC_INTERVAL_S = 2.0  # how often the table is read again (the key cache's bound, too)


def row_lora_id(name: str, path: str, created: datetime) -> int:
    """A table row's lora_int_id: from what the row holds, so every process reading it agrees;
    above any --lora-modules index."""
    stamp = created.astimezone(UTC).isoformat(timespec="microseconds")
    digest = hashlib.blake2b(f"{name}\0{path}\0{stamp}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") >> 2) | (1 << 32)


class AdapterNotFound(LookupError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class ModelLoading(RuntimeError):
    """The engine is not there yet: adapters cannot be checked (503)."""


class AdapterInUse(RuntimeError):
    def __init__(self, name: str, running: int) -> None:
        super().__init__(name)
        self.name = name
        self.running = running


@dataclass(slots=True, frozen=True)
class Adapter:
    name: str
    path: str
    lora_int_id: int
    tenant_id: str | None = None  # None: public
    base_model_name: str | None = None
    source: str = "admin"  # "flag" (--lora-modules) or "admin" (the admin API / the table)
    created: float = field(default_factory=time.time)

    @property
    def request(self) -> LoRARequest:
        return LoRARequest(self.name, self.lora_int_id, self.path)

    def visible_to(self, principal: Principal) -> bool:
        return self.tenant_id is None or principal.is_admin or self.tenant_id == principal.tenant_id


def check_folder(engine: Any, name: str, path: str) -> None:
    """ValueError unless the engine serves LoRA and the PEFT folder fits its model (config and
    tensor shapes: engine/lora/adapter.py, each error naming its field)."""
    from engine.lora.adapter import read_adapter

    inner = getattr(engine, "engine", engine)  # AsyncEngine wraps the LLMEngine
    config = getattr(inner, "config", None)
    lora = getattr(config, "lora", None)
    if lora is None or not lora.enabled:
        raise ValueError(
            f"LoRA adapter {name!r}: LoRA is not enabled: start the server with --enable-lora"
        )
    quantization = getattr(inner, "base_quantization", None)  # DoRA needs float base weights
    read_adapter(path, inner.hf_config, lora.max_lora_rank, check=True, quantization=quantization)


class AdapterRegistry:
    def __init__(self, modules: list[LoRAModule], db: Database | None = None) -> None:
        self.modules = modules
        self.db = db
        self.adapters: dict[str, Adapter] = {}
        self.base_model: str | None = None
        self._engine: Any = None
        self._next_id = 1
        self._running: Counter[str] = Counter()
        self._lock = asyncio.Lock()
        self._refused: set[int] = set()  # rows whose folder did not fit (logged once)
        self._sync: asyncio.Task | None = None

    # -- start-up -----------------------------------------------------------------------------

    async def start(self, engine: Any) -> None:
        """Check every --lora-modules folder (a bad one: ValueError naming the adapter and the
        field, a start-up error), then load the table's rows (a bad one is logged, skipped)."""
        self._engine = engine
        self.base_model = engine.model_name
        for m in self.modules:
            if m.base_model_name is not None and m.base_model_name != engine.model_name:
                raise ValueError(
                    f"--lora-modules {m.name}: base_model_name {m.base_model_name!r} is not the "
                    f"served model ({engine.model_name!r})"
                )
            try:
                await asyncio.to_thread(check_folder, engine, m.name, m.path)
            except ValueError as e:
                raise ValueError(f"--lora-modules {m.name}: {e}") from None
            self._add(m.name, m.path, None, m.base_model_name, "flag")
        if self.db is None:
            return
        await self.refresh()
        if self.adapters:
            log.info("LoRA adapters: %s", ", ".join(self.adapters))
        self._sync = asyncio.create_task(self._sync_loop(), name="tessera-lora-sync")

    async def stop(self) -> None:
        if self._sync is not None:
            self._sync.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sync

    async def refresh(self) -> None:
        """Serve the table's rows as they are now (what the sync loop does every
        SYNC_INTERVAL_S)."""
        async with self._lock:
            await self._sync_rows()

    async def _sync_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(SYNC_INTERVAL_S)
            try:
                await self.refresh()
                failing = False
            except Exception as e:  # noqa: BLE001 - the database is away: try again later
                if not failing:
                    log.warning("LoRA adapters: cannot read the table (%s); retrying", e)
                failing = True

    async def _sync_rows(self) -> None:
        """Under the lock: new rows checked and added, rows gone (or loaded again: another id)
        dropped. A row whose folder does not fit is logged once and not served."""
        async with self.db.session() as s:
            rows = (await s.scalars(select(LoRAAdapterRow))).all()
        ids = {row.name: row_lora_id(row.name, row.path, row.created_at) for row in rows}
        for name, adapter in list(self.adapters.items()):
            if adapter.source == "admin" and ids.get(name) != adapter.lora_int_id:
                del self.adapters[name]
                log.info("LoRA adapter %r unloaded (through another process)", name)
        for row in rows:
            lora_id = ids[row.name]
            if lora_id in self._refused:
                continue
            served = self.adapters.get(row.name)
            if served is not None:
                if served.source == "flag":
                    self._refused.add(lora_id)
                    log.error(
                        "LoRA adapter %r of the database is also a --lora-modules name: the "
                        "flag's is served",
                        row.name,
                    )
                continue
            try:
                await asyncio.to_thread(check_folder, self._engine, row.name, row.path)
            except ValueError as e:
                self._refused.add(lora_id)
                log.error("LoRA adapter %r of the database is not served: %s", row.name, e)
                continue
            self._add(
                row.name, row.path, row.tenant_id, None, "admin", row.created_at.timestamp(),
                lora_id,
            )  # fmt: skip
            if self._sync is not None:
                log.info("LoRA adapter %r loaded (through another process)", row.name)

    def _add(
        self,
        name: str,
        path: str,
        tenant_id: str | None,
        base: str | None,
        source: str,
        created: float | None = None,
        lora_id: int | None = None,
    ) -> Adapter:
        """`lora_id`: a row's (row_lora_id); a --lora-modules adapter takes the next index."""
        if lora_id is None:
            lora_id = self._next_id
            self._next_id += 1
        adapter = Adapter(name, path, lora_id, tenant_id, base, source, created or time.time())
        self.adapters[name] = adapter
        return adapter

    # -- requests ----------------------------------------------------------------------------

    def resolve(self, model: str, principal: Principal) -> Adapter | None:
        """The adapter `model` names and the caller may call; None for the base model (or any
        other name: check_model answers those). AdapterNotFound for another tenant's."""
        adapter = self.adapters.get(model)
        if adapter is None:
            return None
        if not adapter.visible_to(principal):
            raise AdapterNotFound(model)
        return adapter

    def visible(self, principal: Principal) -> list[Adapter]:
        return [a for a in self.adapters.values() if a.visible_to(principal)]

    def acquire(self, name: str) -> None:
        self._running[name] += 1

    def release(self, name: str) -> None:
        self._running[name] -= 1
        if self._running[name] <= 0:
            del self._running[name]

    def running(self, name: str) -> int:
        return self._running.get(name, 0)

    @property
    def active(self) -> list[str]:
        """Names of the adapters that requests run now."""
        return sorted(n for n, c in self._running.items() if c > 0)

    # -- the admin API ---------------------------------------------------------------------------

    async def load(self, name: str, path: str, tenant_id: str | None = None) -> Adapter:
        """Check the folder against the model, record the row, serve it. ValueError (a 400)
        naming the field; nothing is kept from a refused load."""
        check_name(name)
        if not isinstance(path, str) or not path:
            raise ValueError("lora_path: must be a non-empty string")
        if self._engine is None:
            raise ModelLoading
        async with self._lock:
            if name == self.base_model:
                raise ValueError(f"lora_name: {name!r} is the served model's name")
            if name in self.adapters:
                raise ValueError(
                    f"lora_name: the adapter {name!r} is already loaded; unload it first"
                )
            await asyncio.to_thread(check_folder, self._engine, name, path)
            created = utcnow()
            if self.db is not None:
                async with self.db.session(write=True) as s:
                    if tenant_id is not None and await s.get(Tenant, tenant_id) is None:
                        raise ValueError(f"tenant_id: no tenant with id `{tenant_id}`")
                    s.add(
                        LoRAAdapterRow(
                            name=name, path=path, tenant_id=tenant_id, created_at=created
                        )
                    )
                    await s.commit()
            elif tenant_id is not None:
                raise ValueError("tenant_id: owned adapters need the database (keys mode)")
            lora_id = row_lora_id(name, path, created)
            adapter = self._add(name, path, tenant_id, None, "admin", created.timestamp(), lora_id)
        log.info("LoRA adapter %r loaded from %s (owner: %s)", name, path, tenant_id or "public")
        return adapter

    async def unload(self, name: str) -> Adapter:
        """Stop serving `name` and delete its row. AdapterNotFound for an unknown name,
        AdapterInUse while requests run it (nothing changes: retry once they finished)."""
        async with self._lock:
            adapter = self.adapters.get(name)
            if adapter is not None and self.running(name):
                raise AdapterInUse(name, self.running(name))
            deleted = 0
            if self.db is not None:
                async with self.db.session(write=True) as s:
                    result = await s.execute(
                        delete(LoRAAdapterRow).where(LoRAAdapterRow.name == name)
                    )
                    deleted = result.rowcount or 0
                    await s.commit()
            if adapter is None:
                if deleted:  # a row that was not served (its folder no longer fitted)
                    return Adapter(name, "", 0)
                raise AdapterNotFound(name)
            del self.adapters[name]
        log.info("LoRA adapter %r unloaded", name)
        return adapter
