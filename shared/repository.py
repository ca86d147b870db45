"""The SQL of projects, memories, entries, provenance and API keys (a write id's records live in
shared.write_records, the registry's and search's in shared.registry and shared.search). Functions take a session
and never commit: the caller owns the transaction."""

from __future__ import annotations

import secrets
import string
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import (
    ColumnElement,
    Integer,
    Row,
    Select,
    Text,
    any_,
    bindparam,
    delete,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    tuple_,
    update,
)
from sqlalchemy.dialects.postgresql import ARRAY, distinct_on, insert
from sqlalchemy.ext.asyncio import AsyncSession

from shared import iam
from shared.db.models import (
    ApiKey,
    EntryHistory,
    ForgottenProvenance,
    Memory,
    MemoryEntry,
    Project,
)
from shared.decision import Candidate
from shared.events import EntryState
from shared.ids import API_KEY_PREFIX, ENTRY_PREFIX, MEMORY_PREFIX, PROJECT_PREFIX, new_id


def glob_to_like(pattern: str) -> ColumnElement[str]:
    """The LIKE pattern of a glob, lowered by the database: `*` and `?` are the only wildcards; a caller's `%`,
    `_` and `\\` are literal. Lowered as the tags are, by PostgreSQL: Python lowers a word-final "Σ" to "ς" and
    "İ" to two characters, so a tag would not match itself."""
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return func.lower(escaped.replace("*", "%").replace("?", "_"), type_=Text)


def tags_match_any(column: Any, patterns: Sequence[str]) -> Any:
    """SQL condition: some tag in the array column matches some glob (case-insensitive, ORed)."""
    likes = [glob_to_like(p) for p in patterns]
    tag = func.unnest(column).table_valued("tag").render_derived("t")
    return (
        select(literal_column("1"))
        .select_from(tag)
        .where(or_(*[func.lower(tag.c.tag).like(like, escape="\\") for like in likes]))
        .exists()
    )


async def page(session: AsyncSession, query: Select[Any], limit: int, offset: int) -> tuple[list[Any], int]:
    """A page and the total, counted by the statement that reads the page: in two statements (each its own
    snapshot in autocommit) a write between them made the total disagree with the rows. The count is an
    uncorrelated subquery, run once and index-only; `count(*) OVER ()` read every matching row for each page
    (~10 times slower on a memory of 100,000 entries)."""
    total = select(func.count()).select_from(query.order_by(None).subquery())
    rows = (await session.execute(query.add_columns(total.scalar_subquery()).limit(limit).offset(offset))).all()
    if rows:
        return [row[0] for row in rows], int(rows[0][1])
    return [], int(await session.scalar(total) or 0)  # past the end: no row carries the total


# Projects ---------------------------------------------------------------------------------------


async def create_project(session: AsyncSession, name: str) -> Project:
    project = Project(id=new_id(PROJECT_PREFIX), name=name)
    session.add(project)
    await session.flush()
    await session.refresh(project)
    return project


async def get_project(session: AsyncSession, project_id: str) -> Project | None:
    return await session.get(Project, project_id)


async def list_projects(session: AsyncSession, limit: int, offset: int) -> tuple[list[Project], int]:
    return await page(session, select(Project).order_by(Project.created_at, Project.id), limit, offset)


# Memories ---------------------------------------------------------------------------------------


async def create_memory(
    session: AsyncSession,
    *,
    project_id: str,
    name: str,
    description: str | None,
    tags: list[str] | None,
    write_policy: str,
) -> Memory:
    memory = Memory(
        id=new_id(MEMORY_PREFIX),
        project_id=project_id,
        name=name,
        description=description,
        tags=tags,
        write_policy=write_policy,
    )
    session.add(memory)
    await session.flush()
    await session.refresh(memory)
    return memory


def visible(row: Any, project_id: str | None) -> Any:
    """A row of another project is as good as absent (None scope: the admin sees every project)."""
    return row if row is not None and project_id in (None, row.project_id) else None


MemoryLock = Literal["row", "decisions"]


async def get_memory(
    session: AsyncSession, project_id: str | None, memory_id: str, *, lock: MemoryLock | None = None
) -> Memory | None:
    """The memory, locked for the rest of the transaction with `lock`: "row", its row (other edits and deletes of
    the memory wait; writer decisions, which only read it, do not); "decisions", the memory's decisions first
    (`lock_memory`: writer decisions and entry edits wait), then its row, in the writer's order. One that finds it
    deleted meanwhile sees it gone."""
    if lock is None:
        return visible(await session.get(Memory, memory_id), project_id)
    if project_id is not None and await get_memory_project(session, memory_id) != project_id:
        # Told before the lock is waited for: another project's busy memory must not be a wait and a 503
        # where an absent one is a 404 (a memory never changes project).
        return None
    row_lock: bool | dict[str, bool] = True  # FOR UPDATE, as a delete takes
    if lock == "decisions":
        await lock_memory(session, memory_id)
    else:  # FOR NO KEY UPDATE: an entry being inserted (its foreign key's share of the row) neither waits nor is waited for
        row_lock = {"key_share": True}
    return visible(await session.get(Memory, memory_id, with_for_update=row_lock, populate_existing=True), project_id)


_SELECT_MEMORY_PROJECT = select(Memory.project_id).where(Memory.id == bindparam("id"))


async def get_memory_project(session: AsyncSession, memory_id: str) -> str | None:
    """The project of a memory, or None when there is no such memory."""
    return await session.scalar(_SELECT_MEMORY_PROJECT, {"id": memory_id})


async def list_memories(
    session: AsyncSession, project_id: str, tag_patterns: Sequence[str], limit: int, offset: int
) -> tuple[list[Memory], int]:
    query = select(Memory).where(Memory.project_id == project_id)
    if tag_patterns:
        query = query.where(tags_match_any(Memory.tags, tag_patterns))
    return await page(session, query.order_by(Memory.created_at, Memory.id), limit, offset)


async def update_memory(session: AsyncSession, memory: Memory, changes: dict[str, Any]) -> Memory:
    for field, value in changes.items():
        setattr(memory, field, value)
    memory.updated_at = func.now()
    await session.flush()
    await session.refresh(memory)
    return memory


async def delete_memory(session: AsyncSession, memory: Memory) -> None:
    """The memory, its entries (by the foreign key) and the texts of their history (`delete_entry`)."""
    entries = select(MemoryEntry.id).where(MemoryEntry.memory_id == memory.id)
    await _forget_texts_of_history(session, EntryHistory.entry_id.in_(entries))
    await session.execute(delete(Memory).where(Memory.id == memory.id))


# Entries ----------------------------------------------------------------------------------------


async def get_entry(session: AsyncSession, project_id: str | None, entry_id: str) -> MemoryEntry | None:
    return visible(await session.get(MemoryEntry, entry_id), project_id)


async def list_entries(
    session: AsyncSession, memory_id: str, include_invalidated: bool, limit: int, offset: int
) -> tuple[list[MemoryEntry], int]:
    query = select(MemoryEntry).where(MemoryEntry.memory_id == memory_id)
    if not include_invalidated:
        query = query.where(MemoryEntry.invalidated_at.is_(None))
    return await page(session, query.order_by(MemoryEntry.created_at, MemoryEntry.id), limit, offset)


async def lock_memory(session: AsyncSession, memory_id: str) -> None:
    """Serialise decisions on one memory for the rest of the transaction, across every writer replica."""
    await lock_memories(session, [memory_id])


async def lock_memories(session: AsyncSession, memory_ids: Iterable[str]) -> None:
    """`lock_memory` for several memories in one statement."""
    await _lock_keys(session, memory_ids, shared=False)


async def lock_key(session: AsyncSession, key: str) -> None:
    """An advisory lock on any text key until the transaction ends (a memory's id is one such key)."""
    await _lock_keys(session, [key], shared=False)


async def lock_memories_unless_busy(session: AsyncSession, memory_ids: Iterable[str]) -> set[str]:
    """`lock_memories` without waiting: locks those no other transaction holds and returns the others, busy
    (another writer replica deciding on them, maybe waiting on a model; an API edit)."""
    rows = await session.execute(_TRY_LOCK_KEYS, {"keys": sorted(set(memory_ids))})
    return set(rows.scalars())


_LOCK_KEY = "hashtextextended(key, 0)"  # a text key's advisory lock, the same for every way of taking it
_KEYS = "unnest(CAST(:keys AS text[])) AS key"
_TRY_LOCK_KEYS = text(f"SELECT key FROM {_KEYS} WHERE NOT pg_try_advisory_xact_lock({_LOCK_KEY})")
_TRY_LOCK_KEYS_SHARED = text(f"SELECT key FROM {_KEYS} WHERE NOT pg_try_advisory_xact_lock_shared({_LOCK_KEY})")
_LOCK_KEYS = {
    shared: text(f"SELECT {function}({_LOCK_KEY}) FROM {_KEYS}")
    for shared, function in ((False, "pg_advisory_xact_lock"), (True, "pg_advisory_xact_lock_shared"))
}


async def _lock_keys(session: AsyncSession, keys: Iterable[str], *, shared: bool) -> None:
    """Advisory locks on text keys until the transaction ends, in one statement. Taken in one global order, so
    two transactions locking overlapping sets wait for each other instead of deadlocking."""
    await session.execute(_LOCK_KEYS[shared], {"keys": sorted(set(keys))})


# The write path's statements are built once, at import: SQLAlchemy then compiles each once, and a call
# only binds its values. Lists are bound as one array parameter (`= ANY(:ids)`), so the statement's text is
# the same for any length and PostgreSQL prepares it once per connection.

_SELECT_MEMORIES = select(Memory.id, Memory.project_id, Memory.write_policy).where(
    Memory.id == any_(bindparam("ids", type_=ARRAY(Text)))
)


async def load_memories(session: AsyncSession, memory_ids: Iterable[str]) -> dict[str, Row[Any]]:
    """What the writer decides with of each memory: its project and write policy, as plain rows (measured:
    a transaction reading four cost 0.77 ms of client CPU this way against 0.91 ms loading ORM objects)."""
    rows = await session.execute(_SELECT_MEMORIES, {"ids": sorted(set(memory_ids))})
    return {row.id: row for row in rows}


_SELECT_EXACT_COPIES = (
    select(MemoryEntry.memory_id, MemoryEntry.content_hash, MemoryEntry.id, MemoryEntry.content)
    .where(
        MemoryEntry.memory_id == any_(bindparam("memory_ids", type_=ARRAY(Text))),
        MemoryEntry.content_hash == any_(bindparam("hashes", type_=ARRAY(Text))),
        MemoryEntry.invalidated_at.is_(None),
    )
    .ext(distinct_on(MemoryEntry.memory_id, MemoryEntry.content_hash))
    .order_by(MemoryEntry.memory_id, MemoryEntry.content_hash, MemoryEntry.created_at, MemoryEntry.id)
)


async def find_exact_copies(
    session: AsyncSession, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], Candidate]:
    """The oldest valid entry of each (memory id, content hash) pair that has one, in one query."""
    wanted = set(keys)
    # Memories and hashes are matched separately (both index columns), the pairs picked here: a batch's
    # text may also be stored in another of its memories, one row more, never one less.
    rows = await session.execute(
        _SELECT_EXACT_COPIES,
        {"memory_ids": sorted({memory_id for memory_id, _ in wanted}), "hashes": sorted({digest for _, digest in wanted})},
    )
    return {
        (row.memory_id, row.content_hash): Candidate(row.id, row.content, 1.0)
        for row in rows
        if (row.memory_id, row.content_hash) in wanted
    }


_DISTANCE = MemoryEntry.embedding.cosine_distance(bindparam("vector", type_=MemoryEntry.embedding.type))
_SELECT_NEAREST = (
    select(MemoryEntry.id, MemoryEntry.content, _DISTANCE.label("distance"))
    .where(MemoryEntry.memory_id == bindparam("memory_id"), MemoryEntry.invalidated_at.is_(None))
    .order_by(_DISTANCE)
    .limit(bindparam("limit", type_=Integer))
)


async def find_nearest(
    session: AsyncSession, memory_id: str, embedding: Sequence[float], limit: int = 1
) -> list[Candidate]:
    """The most similar valid entries of one memory, by cosine similarity."""
    # hnsw.iterative_scan is set on every connection (shared.db.session): the memory filter cannot starve it.
    parameters = {"memory_id": memory_id, "vector": embedding, "limit": limit}
    rows = (await session.execute(_SELECT_NEAREST, parameters)).all()
    return sorted(
        (Candidate(row.id, row.content, 1.0 - float(row.distance)) for row in rows),
        key=lambda candidate: -candidate.score,
    )


_SELECT_ENTRY_STATES = select(*(MemoryEntry.__table__.c[field] for field in EntryState.model_fields)).where(
    MemoryEntry.id == any_(bindparam("ids", type_=ARRAY(Text)))
)


async def get_entry_states(session: AsyncSession, entry_ids: Iterable[str]) -> dict[str, EntryState]:
    """What a client is shown of each entry, by id, in one query; an id with no entry is left out."""
    rows = await session.execute(_SELECT_ENTRY_STATES, {"ids": sorted(set(entry_ids))})
    return {row.id: EntryState(**row._mapping) for row in rows}


_INSERT_ENTRY = insert(MemoryEntry.__table__)


async def insert_entry(session: AsyncSession, **values: Any) -> str:
    """The new entry's id. One INSERT of a constant statement (compiled once), without loading the row
    into the session: the hot path of writes."""
    entry_id = new_id(ENTRY_PREFIX)
    values["metadata"] = values.pop("metadata_", None)  # the column behind the attribute
    await session.execute(_INSERT_ENTRY, {"id": entry_id, **values})
    return entry_id


async def update_entry(session: AsyncSession, entry: MemoryEntry, changes: dict[str, Any]) -> MemoryEntry:
    for field, value in changes.items():
        setattr(entry, field, value)
    entry.updated_at = func.statement_timestamp()  # as the entry's other times (migration 0009)
    await session.flush()
    await session.refresh(entry)
    return entry


async def delete_entry(session: AsyncSession, entry: MemoryEntry) -> None:
    """The entry, and the texts of its history: a deleted fact is kept in no table (its history held every text it had,
    and the near-copies skipped against it). What happened to it stays recorded, for audit: ids, actions, times."""
    await _forget_texts_of_history(session, EntryHistory.entry_id == entry.id)
    await session.execute(delete(MemoryEntry).where(MemoryEntry.id == entry.id))


async def _forget_texts_of_history(session: AsyncSession, rows: ColumnElement[bool]) -> None:
    await session.execute(
        update(EntryHistory)
        .where(rows, or_(EntryHistory.content_before.is_not(None), EntryHistory.content_after.is_not(None)))
        .values(content_before=None, content_after=None)
    )


async def invalidate_entry(session: AsyncSession, entry_id: str, replacement_id: str) -> None:
    """Retired at the instant its replacement (inserted first) was created: under the memory's lock, so never
    before the retired entry's own `created_at` (migration 0009)."""
    retired_at = select(MemoryEntry.created_at).where(MemoryEntry.id == replacement_id).scalar_subquery()
    await session.execute(
        update(MemoryEntry)
        .where(MemoryEntry.id == entry_id)
        .values(invalidated_at=retired_at, superseded_by_entry_id=replacement_id, updated_at=retired_at)
    )


_REFERENCE_MAX_CHARS = 255  # memory_entries.source_generation_id / source_conversation_id

ProvenanceRef = tuple[str, str, str]
"""(project id, "generation" or "conversation", its id)."""


def _provenance_lock_key(reference: ProvenanceRef) -> str:
    return "provenance\x1f" + "\x1f".join(reference)  # its own namespace: never a memory id's lock


async def hold_provenance(
    session: AsyncSession, references: Iterable[ProvenanceRef], *, wait: bool = True
) -> tuple[dict[ProvenanceRef, datetime], set[ProvenanceRef]]:
    """The references of this transaction's new entries: share-locked until it ends (so forgetting one waits
    for the entries being written, then clears them too), and of those, the ones forgotten, with when.

    Without `wait`, a reference being forgotten right now (its forgetting holds the lock, or waits for it: a share
    lock would queue behind it) is not locked but returned as busy, the second of the pair."""
    wanted = sorted(set(references))
    if not wanted:
        return {}, set()
    keys = {_provenance_lock_key(reference): reference for reference in wanted}
    busy: set[ProvenanceRef] = set()
    if wait:
        await _lock_keys(session, keys, shared=True)
    else:
        rows = await session.execute(_TRY_LOCK_KEYS_SHARED, {"keys": sorted(keys)})
        busy = {keys[key] for key in rows.scalars()}
    held = [reference for reference in wanted if reference not in busy]
    if not held:
        return {}, busy
    # A statement of its own, after the locks: it sees a forgetting committed while this one waited.
    columns = (ForgottenProvenance.project_id, ForgottenProvenance.kind, ForgottenProvenance.reference)
    rows = await session.execute(
        select(*columns, ForgottenProvenance.forgotten_at).where(tuple_(*columns).in_(held))
    )
    return {(row.project_id, row.kind, row.reference): row.forgotten_at for row in rows}, busy


async def clear_provenance(
    session: AsyncSession,
    project_id: str,
    *,
    generation_id: str | None = None,
    conversation_id: str | None = None,
    deleted_at: datetime | None = None,
) -> int:
    """A deleted generation or conversation stops being referenced; the facts learned from it stay. When is
    remembered, so a write still in flight (an extraction, a tool call) cannot bring it back, while one that
    cites it after this moment (a conversation id kept after "clear history") keeps its reference."""
    column = MemoryEntry.source_generation_id if generation_id is not None else MemoryEntry.source_conversation_id
    value = generation_id if generation_id is not None else conversation_id
    kind = "generation" if generation_id is not None else "conversation"
    assert value is not None
    # Exclusive: entries being written with this reference are committed first and cleared below.
    await _lock_keys(session, [_provenance_lock_key((project_id, kind, value))], shared=False)
    if deleted_at is not None and await _forgotten_since(session, (project_id, kind, value), deleted_at):
        # A deletion event delivered again (its ack was lost), or one older than a forgetting made since: applied
        # already. Applied again, it would clear what cites a conversation anew after "clear history".
        return 0
    if len(value) <= _REFERENCE_MAX_CHARS:  # a longer one no entry can hold
        # Of an existing project only: a deletion event of a project deleted since must not fail for ever.
        # clock_timestamp(), not now(): the moment the lock was granted, after every write that held it. Never
        # before the deletion's own time, which another clock stamped (the platform's, NATS'): running ahead, it
        # would make this forgetting look older than its deletion, and the deletion delivered again unapplied.
        moment = func.clock_timestamp() if deleted_at is None else func.greatest(func.clock_timestamp(), deleted_at)
        forgetting = insert(ForgottenProvenance).from_select(
            ["project_id", "kind", "reference", "forgotten_at"],
            select(literal(project_id), literal(kind), literal(value), moment).where(
                select(Project.id).where(Project.id == project_id).exists()
            ),
        )
        await session.execute(
            forgetting.on_conflict_do_update(
                index_elements=["project_id", "kind", "reference"],
                # Never earlier than a forgetting stamped before by a clock running ahead: its deletion, delivered
                # again, would look unapplied.
                set_={"forgotten_at": func.greatest(ForgottenProvenance.forgotten_at, forgetting.excluded.forgotten_at)},
            )
        )
    result = await session.execute(
        update(MemoryEntry)
        .where(MemoryEntry.project_id == project_id, column == value)
        .values({column.key: None})
        .execution_options(synchronize_session=False)
    )
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


async def _forgotten_since(session: AsyncSession, reference: ProvenanceRef, moment: datetime) -> bool:
    columns = (ForgottenProvenance.project_id, ForgottenProvenance.kind, ForgottenProvenance.reference)
    forgotten_at = await session.scalar(
        select(ForgottenProvenance.forgotten_at).where(tuple_(*columns) == tuple_(*map(literal, reference)))
    )
    return forgotten_at is not None and forgotten_at >= moment


# API keys ---------------------------------------------------------------------------------------

_SECRET_ALPHABET = string.ascii_letters + string.digits
_SECRET_CHARS = 40
"""About 238 random bits: nothing to brute-force, which is why a fast hash may stand in for the secret."""


async def create_api_key(
    session: AsyncSession, *, project_id: str, name: str | None, actions: Sequence[str]
) -> tuple[ApiKey, str]:
    """The stored key and its secret; the secret exists only in this return value."""
    secret = iam.SECRET_PREFIX + "".join(secrets.choice(_SECRET_ALPHABET) for _ in range(_SECRET_CHARS))
    key = ApiKey(
        id=new_id(API_KEY_PREFIX),
        project_id=project_id,
        name=name,
        prefix=iam.display_prefix(secret),
        secret_hash=iam.secret_hash(secret),
        actions=list(actions),
    )
    session.add(key)
    await session.flush()
    await session.refresh(key)
    return key, secret


_SELECT_LIVE_KEY = select(ApiKey.id, ApiKey.project_id, ApiKey.actions).where(
    ApiKey.secret_hash == bindparam("secret_hash"), ApiKey.revoked_at.is_(None)
)


async def get_live_api_key(session: AsyncSession, secret_hash: str) -> Row[tuple[str, str, list[str]]] | None:
    """The unrevoked key whose secret has this hash (`iam.secret_hash`): its id, project and actions. The
    probe is by hash, so its timing tells nothing about the secret. A constant statement of plain columns:
    it runs on requests, and builds no statement and loads no ORM object each time."""
    return (await session.execute(_SELECT_LIVE_KEY, {"secret_hash": secret_hash})).first()


async def list_api_keys(
    session: AsyncSession, project_id: str, include_revoked: bool, limit: int, offset: int
) -> tuple[list[ApiKey], int]:
    query = select(ApiKey).where(ApiKey.project_id == project_id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    return await page(session, query.order_by(ApiKey.created_at, ApiKey.id), limit, offset)


async def revoke_api_key(session: AsyncSession, key_id: str) -> bool:
    """False when there is no live key of that id. One statement, so two revocations cannot both succeed."""
    revoked = await session.scalar(
        update(ApiKey)
        .where(ApiKey.id == key_id, ApiKey.revoked_at.is_(None))
        .values(revoked_at=func.now(), updated_at=func.now())
        .returning(ApiKey.id)
    )
    return revoked is not None
