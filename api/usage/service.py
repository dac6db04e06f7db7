"""The usage ledger: one row per request, written in batches off the request path, and
the aggregation the admin API reads.

Interface:

    recorder = UsageRecorder(db)
    await recorder.start()
    recorder.record(UsageRecord(request_id=..., key_id=..., model=..., ...))  # non-blocking
    await recorder.flush()        # write everything queued so far (tests, admin reads)
    await recorder.stop()         # at shutdown: flushes everything, then stops
    await aggregate_usage(db, key_id=, since=, until=, group_by="day"|"hour")
        -> list[UsageBucket]      # per key and UTC day/hour; also KeyService.usage()

record() only appends to an in-memory queue. A background task writes the queue in one
transaction on the database driver itself (api/db/raw_store.py) every `interval`
seconds (0.5) or as soon as `batch_size` (100) rows are waiting. If the database is unreachable the rows stay queued and are retried; beyond
`max_queue` rows the oldest are dropped with an error log (memory must stay bounded
through a long outage). stop() flushes what is queued, so a clean shutdown loses nothing.
On Postgres the ledger commits without waiting for the WAL flush (the pool's connections
run with synchronous_commit off, see api.db.session): a crash of the database server itself may lose the
last fraction of a second of rows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import case, func, select

from api.db.models import ApiKey, UsageRow, utcnow
from api.db.raw_store import raw_store
from api.db.session import Database
from api.keys.fields import aware

log = logging.getLogger(__name__)

GROUP_BY = ("day", "hour")
WRITE_TIMEOUT = 10.0


@dataclass(slots=True)
class UsageRecord:
    request_id: str
    key_id: str | None
    model: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    status_code: int = 200
    queue_time: float | None = None  # seconds waiting for the scheduler
    latency: float | None = None  # seconds from arrival to the last byte
    created_at: datetime = field(default_factory=utcnow)
    tenant_id: str | None = None
    x_request_id: str | None = None  # the client's X-Request-Id, or the generated one
    end_user: str | None = None  # the body's `user`
    lora_adapter: str | None = None  # the LoRA adapter it ran (api/lora/), None: the base


# Through the raw driver (api/db/raw_store.py): SQLAlchemy's executemany of a batch
# held the event loop for tens of ms at 200 requests/s.
INSERT_USAGE = """
INSERT INTO usage_records (request_id, key_id, model, prompt_tokens, completion_tokens,
    cached_tokens, finish_reason, status_code, queue_time, latency, created_at,
    tenant_id, x_request_id, end_user, lora_adapter)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)
"""


class UsageRecorder:
    def __init__(
        self,
        db: Database,
        *,
        interval: float = 0.5,
        batch_size: int = 100,
        max_queue: int = 100_000,
    ) -> None:
        self.db = db
        self.interval = interval
        self.batch_size = batch_size
        self.max_queue = max_queue
        self._queue: deque[UsageRecord] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._flush_lock: asyncio.Lock | None = None
        self._writing = 0  # rows taken off the queue by a write in progress
        self._stopping = False
        self.dropped = 0
        self._store = raw_store(db)

    def _row(self, r: UsageRecord) -> tuple[Any, ...]:
        created = self._store.timestamp(r.created_at)
        return (r.request_id, r.key_id, r.model, r.prompt_tokens, r.completion_tokens,
                r.cached_tokens, r.finish_reason, r.status_code, r.queue_time, r.latency,
                created, r.tenant_id, r.x_request_id, r.end_user, r.lora_adapter)  # fmt: skip

    def record(self, row: UsageRecord) -> None:
        if len(self._queue) >= self.max_queue:
            self._queue.popleft()
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.error("usage ledger queue full: %d usage rows dropped so far", self.dropped)
        self._queue.append(row)
        if len(self._queue) >= self.batch_size and self._wakeup is not None:
            self._wakeup.set()

    @property
    def pending(self) -> int:
        """Rows recorded but not yet committed to the database."""
        return len(self._queue) + self._writing

    async def start(self) -> None:
        if self._task is not None:
            return
        self._stopping = False
        self._wakeup = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task = asyncio.create_task(self._run(), name="tessera-usage-recorder")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # Let a write in progress finish rather than cancel it: a cancellation that
            # lands after the COMMIT would re-queue rows already written.
            self._stopping = True
            assert self._wakeup is not None
            self._wakeup.set()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if not await self.flush():
            log.error("usage ledger: %d rows could not be written at shutdown", self.pending)

    async def flush(self) -> bool:
        """Write everything queued now; False if the database refused (rows kept)."""
        if self._flush_lock is None:
            self._flush_lock = asyncio.Lock()
        async with self._flush_lock:
            while self._queue:
                if not await self._write_batch():
                    return False
        return True

    async def _run(self) -> None:
        assert self._wakeup is not None
        backoff = self.interval
        while not self._stopping:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):
                    await self._wakeup.wait()
            self._wakeup.clear()
            if self._stopping:
                return
            ok = await self.flush()
            # Back off while the database is down instead of retrying twice a second.
            backoff = self.interval if ok else min(backoff * 2, 30.0)

    async def _write_batch(self) -> bool:
        batch = [self._queue.popleft() for _ in range(min(self.batch_size, len(self._queue)))]
        self._writing = len(batch)
        committed = False
        try:
            async with asyncio.timeout(WRITE_TIMEOUT):
                await self._store.executemany(INSERT_USAGE, [self._row(r) for r in batch])
                committed = True
        except asyncio.CancelledError:
            if not committed:
                self._queue.extendleft(reversed(batch))
            raise
        except Exception as exc:
            self._queue.extendleft(reversed(batch))
            log.warning("usage ledger write failed, will retry: %s", type(exc).__name__)
            return False
        finally:
            self._writing = 0
        return True


# -- reading: usage per key and per day / hour ------------------------------------------


@dataclass(slots=True, frozen=True)
class UsageBucket:
    key_id: str | None
    key_name: str | None
    period_start: datetime
    requests: int
    errors: int  # status >= 400
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def aggregate_usage(
    db: Database,
    *,
    key_id: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    group_by: str = "day",
    tenant_id: str | None = None,
) -> list[UsageBucket]:
    """Requests and tokens per key and per day/hour (UTC), oldest bucket first.

    `since` is inclusive, `until` exclusive; `tenant_id` keeps the rows charged to it.
    """
    if group_by not in GROUP_BY:
        raise ValueError(f"group_by must be one of {', '.join(GROUP_BY)}")
    if since is not None and until is not None and aware(since) >= aware(until):
        raise ValueError("since must be earlier than until")
    bucket = _bucket(db, group_by)
    query = (
        select(
            UsageRow.key_id,
            ApiKey.name,
            bucket.label("bucket"),
            func.count().label("requests"),
            func.sum(case((UsageRow.status_code >= 400, 1), else_=0)).label("errors"),
            func.sum(UsageRow.prompt_tokens),
            func.sum(UsageRow.completion_tokens),
            func.sum(UsageRow.cached_tokens),
        )
        .select_from(UsageRow)
        .outerjoin(ApiKey, ApiKey.id == UsageRow.key_id)
        .group_by(UsageRow.key_id, ApiKey.name, bucket)
        .order_by(bucket, UsageRow.key_id)
    )
    if key_id is not None:
        query = query.where(UsageRow.key_id == key_id)
    if tenant_id is not None:
        query = query.where(UsageRow.tenant_id == tenant_id)
    if since is not None:
        query = query.where(UsageRow.created_at >= aware(since))
    if until is not None:
        query = query.where(UsageRow.created_at < aware(until))
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    return [
        UsageBucket(
            key_id=r[0],
            key_name=r[1],
            period_start=_bucket_time(r[2]),
            requests=int(r[3]),
            errors=int(r[4] or 0),
            prompt_tokens=int(r[5] or 0),
            completion_tokens=int(r[6] or 0),
            cached_tokens=int(r[7] or 0),
        )
        for r in rows
    ]


@dataclass(slots=True, frozen=True)
class TenantShare:
    tenant_id: str
    tokens: int  # prompt + completion tokens of the requests that ended in the window
    requests: int


async def tenant_shares(db: Database, since: datetime) -> list[TenantShare]:
    """Tokens served per tenant by requests that ended at or after `since` (the ledger
    writes a row when a request ends; its created_at is the arrival)."""
    tokens = func.sum(UsageRow.prompt_tokens + UsageRow.completion_tokens)
    query = (
        select(UsageRow.tenant_id, tokens, func.count())
        .where(UsageRow.tenant_id.is_not(None), UsageRow.created_at >= aware(since))
        .group_by(UsageRow.tenant_id)
    )
    async with db.session() as session:
        rows = (await session.execute(query)).all()
    return [TenantShare(r[0], int(r[1] or 0), int(r[2])) for r in rows]


def _bucket(db: Database, group_by: str) -> Any:
    if db.is_sqlite:
        fmt = "%Y-%m-%d 00:00:00" if group_by == "day" else "%Y-%m-%d %H:00:00"
        return func.strftime(fmt, UsageRow.created_at)
    # Sessions run with TimeZone=UTC, so buckets are UTC days/hours.
    return func.date_trunc(group_by, UsageRow.created_at)


def _bucket_time(value: Any) -> datetime:
    if isinstance(value, datetime):
        return aware(value)
    return datetime.fromisoformat(str(value)).replace(tzinfo=UTC)
