"""UsageRecorder (batched, lossless on clean stop) and the usage aggregation query."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import func, select

from api.db.models import UsageRow
from api.db.session import Database
from api.keys.service import KeyService
from api.usage.service import UsageRecord, UsageRecorder


async def _rows(db: Database) -> list[UsageRow]:
    async with db.session() as session:
        return list((await session.scalars(select(UsageRow).order_by(UsageRow.id))).all())


async def test_many_records_then_stop_writes_every_row(db: Database) -> None:
    recorder = UsageRecorder(db, interval=0.05, batch_size=100)
    await recorder.start()
    for i in range(1234):
        recorder.record(
            UsageRecord(
                request_id=f"req-{i}",
                key_id=None,
                model="m",
                prompt_tokens=i,
                completion_tokens=2 * i,
                cached_tokens=i % 7,
                finish_reason="stop" if i % 2 else "length",
                status_code=200,
                queue_time=0.01,
                latency=0.5,
            )
        )
        if i % 300 == 0:
            await asyncio.sleep(0)  # let the background writer interleave
    await recorder.stop()
    rows = await _rows(db)
    assert len(rows) == 1234 and recorder.pending == 0
    assert sorted(int(r.request_id[4:]) for r in rows) == list(range(1234))
    first = next(r for r in rows if r.request_id == "req-5")
    assert (first.prompt_tokens, first.completion_tokens, first.cached_tokens) == (5, 10, 5)
    assert (first.finish_reason, first.status_code, first.queue_time, first.latency) == (
        "stop",
        200,
        0.01,
        0.5,
    )
    assert first.created_at.tzinfo is not None


async def test_background_flush_without_stop(db: Database) -> None:
    recorder = UsageRecorder(db, interval=0.05)
    await recorder.start()
    try:
        recorder.record(UsageRecord(request_id="r", key_id=None, model="m"))
        for _ in range(200):
            if recorder.pending == 0 and await _rows(db):
                break
            await asyncio.sleep(0.02)
        assert [r.request_id for r in await _rows(db)] == ["r"]
    finally:
        await recorder.stop()


async def test_rows_are_kept_through_an_outage(database_url: str, tmp_path) -> None:
    # A database that is not reachable yet: rows wait in memory, nothing is lost or raised.
    db = Database.from_url(database_url)
    try:
        recorder = UsageRecorder(db, interval=0.05)
        await recorder.start()
        for i in range(5):
            recorder.record(UsageRecord(request_id=f"r{i}", key_id=None, model="m"))
        await asyncio.sleep(0.2)  # flushes fail: the tables do not exist yet
        assert recorder.pending == 5
        await db.upgrade()
        await recorder.stop()
        assert len(await _rows(db)) == 5
    finally:
        await db.dispose()


async def test_usage_aggregation_per_key_day_and_hour(db: Database) -> None:
    keys = KeyService(db)
    alice, _ = await keys.create("alice")
    bob, _ = await keys.create("bob")
    day = datetime(2025, 3, 1, tzinfo=UTC)
    recorder = UsageRecorder(db)
    for key, hour, prompt, completion, status in [
        (alice, 1, 10, 5, 200),
        (alice, 1, 20, 5, 200),
        (alice, 2, 1, 0, 500),
        (bob, 1, 7, 3, 200),
        (alice, 25, 100, 50, 200),  # next day
    ]:
        recorder.record(
            UsageRecord(
                request_id=f"{key.name}-{hour}-{prompt}",
                key_id=key.id,
                model="m",
                prompt_tokens=prompt,
                completion_tokens=completion,
                cached_tokens=1,
                status_code=status,
                created_at=day + timedelta(hours=hour, minutes=30),
            )
        )
    await recorder.flush()

    daily = sorted(await keys.usage(group_by="day"), key=lambda b: (b.period_start, b.key_name))
    assert [(b.key_name, b.period_start, b.requests, b.errors) for b in daily] == [
        ("alice", day, 3, 1),
        ("bob", day, 1, 0),
        ("alice", day + timedelta(days=1), 1, 0),
    ]
    assert (daily[0].prompt_tokens, daily[0].completion_tokens, daily[0].cached_tokens) == (
        31,
        10,
        3,
    )
    assert daily[0].total_tokens == 41

    hourly = await keys.usage(key_id=alice.id, group_by="hour", until=day + timedelta(days=1))
    assert [(b.period_start, b.requests, b.prompt_tokens) for b in hourly] == [
        (day + timedelta(hours=1), 2, 30),
        (day + timedelta(hours=2), 1, 1),
    ]
    later = await keys.usage(since=day + timedelta(hours=2, minutes=30))
    assert [(b.key_name, b.requests) for b in later] == [("alice", 1), ("alice", 1)]
    assert await keys.usage(key_id="nobody") == []
    with pytest.raises(ValueError, match="group_by"):
        await keys.usage(group_by="week")
    with pytest.raises(ValueError, match="since must be earlier"):
        await keys.usage(since=day, until=day)
    async with db.session() as session:
        assert await session.scalar(select(func.count()).select_from(UsageRow)) == 5
