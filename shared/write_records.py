"""A write id's records: the claim a caller takes on a client's Idempotency-Key, the outcome the writer stores under
it, and the audit history of every decision. Functions take a session and never commit: the caller owns the
transaction."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import (
    JSON,
    Row,
    Table,
    Text,
    and_,
    any_,
    bindparam,
    column,
    func,
    or_,
    select,
    true,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, insert
from sqlalchemy.ext.asyncio import AsyncSession

from shared.db.models import EntryHistory, WriteOutcome
from shared.repository import page, visible

STALE_PENDING = timedelta(seconds=30)
"""A pending write this old has lost its caller; a retry with its key may publish it again."""
STALE_PUBLISHED = timedelta(hours=1)
"""A pending write known to be on the stream is waited for by a retry, not published again, unless it is this old:
then its event may have been lost (a purge, a dead letter whose failure could not be recorded), and the next retry
publishes it again. While no writer runs, that queues at most one copy an hour, which the writer skips."""


async def get_write_outcome(session: AsyncSession, write_id: str) -> WriteOutcome | None:
    return await session.get(WriteOutcome, write_id)


async def get_write_outcome_for_project(
    session: AsyncSession, project_id: str | None, write_id: str
) -> WriteOutcome | None:
    return visible(await session.get(WriteOutcome, write_id), project_id)


_SELECT_OUTCOMES = select(WriteOutcome.__table__).where(
    WriteOutcome.write_id == any_(bindparam("ids", type_=ARRAY(Text)))
)


async def get_write_outcomes(session: AsyncSession, write_ids: Iterable[str]) -> dict[str, Row[Any]]:
    """The stored records of these write ids (a pending claim, a failed attempt, an applied outcome), as plain
    rows like `load_memories`: every keyed write has one."""
    rows = await session.execute(_SELECT_OUTCOMES, {"ids": sorted(set(write_ids))})
    return {row.write_id: row for row in rows}


def claimed_by_another_request(outcome: WriteOutcome, request_hash: str | None) -> bool:
    """The write id (a client's key) was claimed for a request other than the one hashed (records from before
    request hashes, and callers without one, are not compared)."""
    return request_hash is not None and outcome.request_hash not in (None, request_hash)


async def claim_write_id(
    session: AsyncSession,
    write_id: str,
    project_id: str,
    memory_id: str,
    request_hash: str | None = None,
    *,
    retry_failed: Collection[str] | None = None,
) -> tuple[WriteOutcome, bool]:
    """Record a write as pending unless its id is known. Returns the record and whether this call owns the
    attempt: a new id, or one whose earlier attempt failed (a retry; with `retry_failed`, only a failure of those
    codes), or one left pending by a caller that gave up before its event was known to be published (its publish
    may never have happened; the bus drops it if it did, within its duplicate window). A pending write known to be
    published is waited for (see `STALE_PUBLISHED`). The caller compares the record's `request_hash` with its own
    before it uses the record."""
    inserted = await session.scalar(
        insert(WriteOutcome)
        .values(
            write_id=write_id, project_id=project_id, memory_id=memory_id, status="pending", request_hash=request_hash
        )
        .on_conflict_do_nothing(index_elements=[WriteOutcome.write_id])
        .returning(WriteOutcome)
    )
    if inserted is not None:
        return inserted, True  # the common case: one round trip
    # Never this caller's to retry when another request first used the key (see `claimed_by_another_request`).
    same_request = (
        true()
        if request_hash is None
        else or_(WriteOutcome.request_hash.is_(None), WriteOutcome.request_hash == request_hash)
    )
    retried = await session.scalar(
        update(WriteOutcome)
        .where(
            WriteOutcome.write_id == write_id,
            same_request,
            or_(
                and_(
                    WriteOutcome.status == "failed",
                    true() if retry_failed is None else WriteOutcome.error_code.in_(list(retry_failed)),
                ),
                and_(
                    WriteOutcome.status == "pending",
                    WriteOutcome.updated_at < func.now() - STALE_PENDING,
                    or_(WriteOutcome.published_at.is_(None), WriteOutcome.published_at < func.now() - STALE_PUBLISHED),
                ),
            ),
        )
        .values(status="pending", updated_at=func.now(), published_at=None)
        .returning(WriteOutcome.write_id)
    )
    # Read after the take-over: as it stands now, whether this call took it over or another one did meanwhile
    # (whose UPDATE this one waited for). Read before, a waiter kept a claim given up since and missed its release.
    outcome = await session.get(WriteOutcome, write_id, populate_existing=True)
    assert outcome is not None
    return outcome, retried is not None


async def record_pending_write(session: AsyncSession, write_id: str, project_id: str, memory_id: str) -> None:
    """A published write not decided in time is recorded as pending, unless the writer recorded its outcome
    meanwhile (a failure included: nothing is queued any more to make it pending again)."""
    await session.execute(
        insert(WriteOutcome)
        .values(write_id=write_id, project_id=project_id, memory_id=memory_id, status="pending", published_at=func.now())
        .on_conflict_do_nothing(index_elements=[WriteOutcome.write_id])
    )


async def record_published(session: AsyncSession, write_id: str, claimed_at: datetime) -> None:
    """A claimed write whose event the stream took and no writer has decided yet: a retry waits for it. Only the
    claim made at `claimed_at`: a later one (the write failed meanwhile, and a retry claimed it) has not published."""
    await session.execute(
        update(WriteOutcome)
        .where(WriteOutcome.write_id == write_id, WriteOutcome.status == "pending", WriteOutcome.updated_at == claimed_at)
        .values(published_at=func.now())
    )


async def fail_pending_write(session: AsyncSession, write_id: str, memory_id: str, code: str, message: str) -> bool:
    """A write's pending record (a claim, or a 202's) becomes failed, so a retry with its key may try again and
    its status stops saying pending; a record already applied or failed is left alone. False when there was
    none to change."""
    failed = await session.scalar(
        update(WriteOutcome)
        .where(WriteOutcome.write_id == write_id, WriteOutcome.memory_id == memory_id, WriteOutcome.status == "pending")
        .values(
            status="failed",
            error_code=code,
            error_message=message,
            failed_attempts=WriteOutcome.failed_attempts + 1,
            updated_at=func.now(),
        )
        .returning(WriteOutcome.write_id)
    )
    return failed is not None


async def release_write_claim(session: AsyncSession, write_id: str, claimed_at: datetime) -> None:
    """The owner of the claim made at `claimed_at` could not publish it: age the claim so the next retry owns it at
    once instead of after STALE_PENDING. A publish that did land is harmless: the retry reuses its message id. A
    later claim (the write failed meanwhile, and a retry claimed it) is not this owner's to release."""
    await session.execute(
        update(WriteOutcome)
        .where(WriteOutcome.write_id == write_id, WriteOutcome.status == "pending", WriteOutcome.updated_at == claimed_at)
        .values(updated_at=func.now() - 2 * STALE_PENDING, published_at=None)
    )


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    """A write's outcome as the writer stores it, the write id's idempotency record. Plain data: building
    each as an ORM object cost more CPU than storing it."""

    write_id: str
    project_id: str
    memory_id: str
    status: str  # applied | failed
    action: str | None = None
    entry_id: str | None = None
    score: float | None = None
    error_code: str | None = None
    error_message: str | None = None
    failed_attempts: int = 0


@dataclass(frozen=True, slots=True)
class HistoryRow:
    """One audit record of `entry_history`, as stored (plain data, like OutcomeRow)."""

    project_id: str
    memory_id: str
    entry_id: str
    action: str
    write_id: str | None = None
    related_entry_id: str | None = None
    rule: str | None = None
    score: float | None = None
    candidate_ids: list[str] | None = None
    model: str | None = None
    prompt_version: str | None = None
    content_before: str | None = None
    content_after: str | None = None


_FIELDS = {record: [field.name for field in fields(record)] for record in (OutcomeRow, HistoryRow)}
"""Each record's columns, in the order its statement and its JSON rows share."""


def _json_rows(name: str, table: Table, keys: Sequence[str]) -> Any:
    """The rows of a JSON array parameter as a table with the columns' own types (`json_to_recordset`)."""
    columns = [column(key, table.c[key].type) for key in keys]
    return func.json_to_recordset(bindparam(name, type_=JSON)).table_valued(*columns).render_derived(
        name=name, with_types=True
    )


def _insert_json_rows(table: Table, record: type, name: str) -> Any:
    keys = _FIELDS[record]
    rows = _json_rows(name, table, keys)
    return insert(table).from_select(keys, select(*(rows.c[key] for key in keys)))


_UPSERT_OUTCOMES = _insert_json_rows(WriteOutcome.__table__, OutcomeRow, "outcomes")
_UPSERT_OUTCOMES = _UPSERT_OUTCOMES.on_conflict_do_update(
    index_elements=[WriteOutcome.write_id],
    set_={name: _UPSERT_OUTCOMES.excluded[name] for name in _FIELDS[OutcomeRow] if name != "write_id"}
    | {"updated_at": func.now()},
)
# Outcomes and audit records in one statement, whatever their number: one round trip, and the rows travel as
# one JSON parameter each instead of one bound row each (a third of the CPU for a batch of four writes).
_SAVE_RECORDS = _insert_json_rows(EntryHistory.__table__, HistoryRow, "history").add_cte(
    _UPSERT_OUTCOMES.cte("saved_outcomes")
)


async def save_records(
    session: AsyncSession, outcomes: Sequence[OutcomeRow], history: Sequence[HistoryRow]
) -> None:
    """Insert or overwrite the writes' outcomes (a pending claim may exist) and append audit records."""
    # One statement cannot upsert a row twice: of a write id's records, the last is stored.
    latest = {record.write_id: record for record in outcomes}
    if latest or history:
        await session.execute(
            _SAVE_RECORDS,
            {"outcomes": [_plain(r) for r in latest.values()], "history": [_plain(r) for r in history]},
        )


def _plain(record: OutcomeRow | HistoryRow) -> dict[str, Any]:
    values = {name: getattr(record, name) for name in _FIELDS[type(record)]}
    # JSON has no NaN or infinity (PostgreSQL refuses the document): a score that is not a number is none.
    if isinstance(score := values["score"], float) and not math.isfinite(score):
        values["score"] = None
    return values


async def list_history(session: AsyncSession, entry_id: str, limit: int, offset: int) -> tuple[list[EntryHistory], int]:
    """A page of the entry's records, oldest first, and how many it has: an entry skipped against at every turn
    gathers one record a skip."""
    query = (
        select(EntryHistory)
        .where(or_(EntryHistory.entry_id == entry_id, EntryHistory.related_entry_id == entry_id))
        .order_by(EntryHistory.id)
    )
    return await page(session, query, limit, offset)
