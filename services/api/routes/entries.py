"""Memory entries. Creation goes through the bus to the writer; the API waits for its decision."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.deps import PrincipalDep, ReadSessionDep, SessionDep, SettingsDep, require, scope
from services.api.errors import ApiError, envelope, invalid, not_found
from services.api.pagination import Flag, PagingDep, paged
from services.api.routes.memories import load_memory, writable_memory_project
from services.api.routing import CheckedRoute
from services.api.schemas import (
    EntryCreate,
    EntryOut,
    EntryUpdate,
    EntryWritten,
    Page,
    Timestamp,
    WriteAccepted,
)
from shared import bus, write_records
from shared import repository as repo
from shared.db.models import MemoryEntry
from shared.embeddings import EmbeddingError, embed_texts
from shared.events import (
    EntryChangeKind,
    MemoryEntryChanged,
    MemoryWriteOutcome,
    MemoryWriteRequested,
    WriteAction,
)
from shared.guard import content_hash
from shared.ids import (
    ENTRY_PREFIX,
    EVENT_PREFIX,
    IDEMPOTENCY_KEY,
    is_valid_id,
    keyed_write_id,
    new_id,
    new_write_id,
)
from shared.settings import Settings
from shared.write_gateway import IdempotencyKeyReused, ReplayedOutcome
from shared.write_records import HistoryRow

router = APIRouter(prefix="/memory-entries", tags=["memory entries"], route_class=CheckedRoute)


async def load_entry(session: AsyncSession, principal_scope: str | None, entry_id: str) -> MemoryEntry:
    entry = None
    if is_valid_id(entry_id, ENTRY_PREFIX):
        entry = await repo.get_entry(session, principal_scope, entry_id)
    if entry is None:
        raise not_found("memory entry", entry_id)
    return entry


async def _locked(session: AsyncSession, memory_id: str, entry_id: str) -> MemoryEntry:
    """The entry as it stands under its memory's lock, which keeps an edit from interleaving with a writer
    decision or another edit; one deleted meanwhile is a 404 here rather than a failed UPDATE later."""
    await repo.lock_memory(session, memory_id)
    current = await session.get(MemoryEntry, entry_id, populate_existing=True)
    if current is None:
        raise not_found("memory entry", entry_id)
    return current


REPLAYED_HEADER = "Idempotent-Replayed"
"""`true` on an answer that repeats the first outcome of the same write (a retry with its Idempotency-Key): the
call itself wrote nothing, whatever its `action` says."""

_REPLAYED = {
    REPLAYED_HEADER: {
        "description": "`true` when this answer repeats the first outcome of the Idempotency-Key: nothing was written now",
        "schema": {"type": "string", "enum": ["true"]},
    }
}
WRITE_RESPONSES: dict[int | str, dict[str, Any]] = {
    201: {"model": EntryWritten, "description": "`created`", "headers": _REPLAYED},
    200: {"model": EntryWritten, "description": "`skipped`, `updated` or `superseded`", "headers": _REPLAYED},
    202: {"model": WriteAccepted, "description": "queued; the writer has not decided within the timeout"},
}
"""What a write answers, on every route that writes through the dedup algorithm."""


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    summary="Write an entry through the dedup algorithm",
    dependencies=[require("memories:CreateMemoryEntry")],
    responses=WRITE_RESPONSES,
)
async def create_entry(
    body: EntryCreate,
    request: Request,
    session: ReadSessionDep,
    principal: PrincipalDep,
    idempotency_key: Annotated[str | None, Header(description="retries with the same key get the first outcome")] = None,
) -> JSONResponse:
    project_id = await writable_memory_project(request, session, principal, body.memory_id)
    event = MemoryWriteRequested(
        event_id=write_id_for(project_id, idempotency_key, request),
        project_id=project_id,
        memory_id=body.memory_id,
        content=body.content,
        source_type=body.source_type,
        tags=body.tags,
        metadata=body.metadata,
        duplicate_threshold=body.duplicate_threshold,
        write_policy=body.write_policy,
    )
    return await submit_write(request, session, event, fresh_id=idempotency_key is None)


def write_id_for(project_id: str, idempotency_key: str | None, request: Request) -> str:
    """A client's Idempotency-Key names its write within the project; without one, every call is new."""
    if idempotency_key is None:
        return new_write_id()
    if len(request.headers.getlist("idempotency-key")) > 1:  # FastAPI hands the route the first
        raise invalid("Idempotency-Key is given more than once: which one names the write cannot be told",
                      "Idempotency-Key")
    if not IDEMPOTENCY_KEY.fullmatch(idempotency_key):
        raise invalid("Idempotency-Key must be 1..255 visible ASCII characters", "Idempotency-Key")
    return keyed_write_id(project_id, idempotency_key)


async def submit_write(
    request: Request, session: AsyncSession, event: MemoryWriteRequested, *, fresh_id: bool
) -> JSONResponse:
    """Hand the write to the writer and answer with its decision (201/200), its error, or 202 pending."""
    # Give the connection back while waiting on the writer: a waiting request must not hold a pool slot.
    await session.rollback()
    try:
        outcome = await request.app.state.gateway.submit(
            event, timeout=request.app.state.settings.memories_write_timeout_s, fresh_id=fresh_id, client_key=not fresh_id
        )
    except bus.BusUnavailable as exc:
        if not exc.sent:
            raise ApiError(503, f"the message bus is unavailable ({exc}); the write was not sent: retry") from exc
        # Not "failed": a publish the bus did not confirm in time (a hung server) may still reach the stream and be
        # applied. Its write id lets the client look it up (404 until it is); a retry is safe either way (with the
        # same Idempotency-Key; without one, the same text is skipped as an exact copy).
        raise ApiError(
            503,
            f"the message bus did not confirm the write ({exc}); it may still be applied: look it up by its "
            "write_id, or retry",
            meta={"write_id": event.write_id},
        ) from exc
    except IdempotencyKeyReused as exc:
        raise ApiError(
            409, "this Idempotency-Key was first used for a different request", meta={"write_id": exc.write_id}
        ) from exc
    if outcome is None:
        accepted = WriteAccepted(write_id=event.write_id, status="pending")
        return JSONResponse(accepted.model_dump(), status_code=status.HTTP_202_ACCEPTED)
    return await _answer(session, outcome)


async def _answer(session: AsyncSession, outcome: MemoryWriteOutcome) -> JSONResponse:
    answer = await _decided(session, outcome)
    if isinstance(outcome, ReplayedOutcome):
        answer.headers[REPLAYED_HEADER] = "true"
    return answer


async def _decided(session: AsyncSession, outcome: MemoryWriteOutcome) -> JSONResponse:
    if outcome.error is not None:
        # The contract's code for the status (the writer's own code, e.g. EMBEDDING_UNAVAILABLE, is in the
        # write's status); the write id lets a client look the write up.
        return envelope(outcome.error.status, outcome.error.message, meta={"write_id": outcome.write_id})
    # The writer's reply carries the entry as of its commit; an outcome read back from storage does not.
    entry = outcome.entry
    if entry is None and outcome.entry_id:
        entry = (await repo.get_entry_states(session, [outcome.entry_id])).get(outcome.entry_id)
    if entry is None or outcome.action is None:
        return envelope(
            409,
            "the entry this write produced has since been deleted; to write the fact again, send it with a new "
            "Idempotency-Key",
            meta={"write_id": outcome.write_id},
        )
    written = EntryWritten(**entry.model_dump(), action=outcome.action, write_id=outcome.write_id)
    code = status.HTTP_201_CREATED if outcome.action is WriteAction.CREATED else status.HTTP_200_OK
    return JSONResponse(written.model_dump(mode="json"), status_code=code)


@router.get(
    "",
    summary="List the entries of a memory (valid ones unless include_invalidated)",
    dependencies=[require("memories:ListMemoryEntries")],
)
async def list_entries(
    session: ReadSessionDep,
    principal: PrincipalDep,
    paging: PagingDep,
    memory_id: Annotated[str, Query()],
    include_invalidated: Flag = False,
) -> Page[EntryOut]:
    memory = await load_memory(session, scope(principal), memory_id)
    rows, total = await repo.list_entries(session, memory.id, include_invalidated, paging.limit, paging.offset)
    return paged([EntryOut.of(e) for e in rows], total, paging)


@router.get(
    "/{entry_id}",
    summary="Get an entry, also when invalidated (audit)",
    dependencies=[require("memories:GetMemoryEntry")],
)
async def get_entry(entry_id: str, session: ReadSessionDep, principal: PrincipalDep) -> EntryOut:
    return EntryOut.of(await load_entry(session, scope(principal), entry_id))


class HistoryRecord(BaseModel):
    write_id: str | None
    entry_id: str
    related_entry_id: str | None
    action: str
    rule: str | None = Field(
        description="why: the decision's rule (`exact_copy`, `near_duplicate`, `merged`, a fallback after a colon as in "
        "`arbitration_failed:merged` or `merged:exact_copy`), or what an edit changed (`changed:tags,metadata`)"
    )
    score: float | None
    candidate_ids: list[str] | None
    model: str | None
    prompt_version: str | None
    content_before: str | None
    content_after: str | None
    created_at: Timestamp


class History(Page[HistoryRecord]):
    entry_id: str


@router.get(
    "/{entry_id}/history",
    summary="A page of the decisions that touched an entry, oldest first (also after it was invalidated)",
    dependencies=[require("memories:GetMemoryEntry")],
)
async def entry_history(entry_id: str, session: ReadSessionDep, principal: PrincipalDep, paging: PagingDep) -> History:
    entry = await load_entry(session, scope(principal), entry_id)
    records, total = await write_records.list_history(session, entry.id, paging.limit, paging.offset)
    return History(
        entry_id=entry.id,
        data=[HistoryRecord.model_validate(r, from_attributes=True) for r in records],
        total=total,
        limit=paging.limit,
        offset=paging.offset,
    )


@router.put(
    "/{entry_id}",
    summary="Edit an entry: tags/metadata replaced, new content re-embedded, no dedup",
    dependencies=[require("memories:UpdateMemoryEntry")],
)
async def update_entry(
    entry_id: str,
    body: EntryUpdate,
    request: Request,
    session: SessionDep,
    principal: PrincipalDep,
    settings: SettingsDep,
) -> EntryOut:
    entry = _editable(await load_entry(session, scope(principal), entry_id))
    changes: dict[str, Any] = {}
    if "tags" in body.model_fields_set:
        changes["tags"] = body.tags or None
    if "metadata" in body.model_fields_set:
        changes["metadata_"] = body.metadata or None
    content = body.content
    if "content" in body.model_fields_set and content is None:
        raise invalid("content cannot be null", "content")
    memory_id, entry_id, vector = entry.memory_id, entry.id, None
    if content is not None and content != entry.content:
        # Embedded outside any transaction, before the lock: the model may take seconds (a remote one up to 30 s),
        # and neither the memory's decisions nor a pooled connection wait for it.
        await session.rollback()
        vector = await _embedding(content, settings)
    entry = _editable(await _locked(session, memory_id, entry_id))  # invalidated while this edit waited, too
    before = entry.content
    if content is not None and content != entry.content:
        if vector is None:  # a decision rewrote the entry while this edit waited for the lock
            vector = await _embedding(content, settings)
        changes.update(
            content=content,
            content_hash=content_hash(content),
            embedding=vector,
            embedding_model=settings.embedding_model,
        )
    # What the edit changes, named in its audit record: a tags-only edit read as an edit that changed nothing.
    # An entry stored with [] or {} (before writes stored them as none) has none to change either.
    changed = [name for name, column in _EDITABLE if column in changes and changes[column] != (getattr(entry, column) or None)]
    if not changed:  # nothing asked for, or nothing new: no new updated_at, no audit record of an edit that did nothing
        return EntryOut.of(entry)
    entry = await repo.update_entry(session, entry, changes)
    record = _edit_record(entry, "edited", before, entry.content, rule=f"changed:{','.join(changed)}")
    await write_records.save_records(session, [], [record])
    await session.commit()
    await _announce(request, entry, EntryChangeKind.UPDATED)
    return EntryOut.of(entry)


_EDITABLE = (("content", "content"), ("tags", "tags"), ("metadata", "metadata_"))
"""An edit's fields, as the API and the entry name them."""


def _editable(entry: MemoryEntry) -> MemoryEntry:
    """An invalidated entry is history: kept as it was, never rewritten (it may still be deleted)."""
    if entry.invalidated_at is None:
        return entry
    successor = entry.superseded_by_entry_id
    raise ApiError(
        409,
        f"memory entry {entry.id} was invalidated"
        + (f" (superseded by {successor}); edit that one" if successor else "")
        + ": its history is kept as it was",
        meta={"superseded_by_entry_id": successor} if successor else None,
    )


async def _embedding(content: str, settings: Settings) -> list[float]:
    try:
        [vector] = await embed_texts(
            [content], model=settings.embedding_model, dimensions=settings.embedding_dimensions, purpose="write"
        )
    except EmbeddingError as exc:
        raise ApiError(503, str(exc)) from exc
    return vector


@router.delete(
    "/{entry_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete an entry outright",
    dependencies=[require("memories:DeleteMemoryEntry")],
)
async def delete_entry(entry_id: str, request: Request, session: SessionDep, principal: PrincipalDep) -> Response:
    entry = await load_entry(session, scope(principal), entry_id)
    entry = await _locked(session, entry.memory_id, entry.id)
    await write_records.save_records(session, [], [_edit_record(entry, "deleted", None, None)])  # its text goes with it
    await repo.delete_entry(session, entry)
    await session.commit()
    await _announce(request, entry, EntryChangeKind.DELETED)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


async def _announce(request: Request, entry: MemoryEntry, kind: EntryChangeKind) -> None:
    """The change feed, best-effort (the change is committed), published after the answer's way: while the bus
    reconnects, the publish waits for it (or its acknowledgement, up to ~5 s), and the answer need not. The
    client's buffer keeps it meanwhile, so a short reconnect loses nothing."""
    change = MemoryEntryChanged(
        event_id=new_id(EVENT_PREFIX), project_id=entry.project_id, memory_id=entry.memory_id, entry_id=entry.id, kind=kind
    )
    announcing = asyncio.create_task(
        bus.announce_entry_change(request.app.state.nats.jetstream(), change, msg_id=change.event_id)
    )
    request.app.state.announcing.add(announcing)  # held until done: a task nothing refers to may be collected
    announcing.add_done_callback(request.app.state.announcing.discard)


def _edit_record(
    entry: MemoryEntry, action: str, before: str | None, after: str | None, rule: str | None = None
) -> HistoryRow:
    return HistoryRow(
        project_id=entry.project_id,
        memory_id=entry.memory_id,
        entry_id=entry.id,
        action=action,
        rule=rule,
        content_before=before,
        content_after=after,
    )
