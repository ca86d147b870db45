"""Applying one write event: the writer's unit of work around `shared.decision.decide`.

Order matters: the embedding (the expensive part) is computed before the memory's lock is taken; inside
one transaction the lock is taken, the write id's stored outcome is reused if it exists, the decision is
made and applied, and the outcome is stored with it. A redelivered event therefore has one effect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import repository as repo
from shared.db.models import EntryHistory, Memory, MemoryEntry, WriteOutcome
from shared.decision import Consolidate, Decision, IncomingWrite, WritePolicy, decide
from shared.embeddings import EmbeddingError
from shared.events import EntryChangeKind, MemoryWriteOutcome, MemoryWriteRequested, WriteAction, WriteError
from shared.guard import content_hash

Embed = Callable[[Sequence[str]], Awaitable[list[list[float]]]]

_ERROR_STATUS = {"EMBEDDING_UNAVAILABLE": 503, "RESOURCE_NOT_FOUND": 404}


@dataclass(frozen=True, slots=True)
class AppliedWrite:
    outcome: MemoryWriteOutcome
    change: EntryChangeKind | None  # what the change feed announces; None for skips and replays


def _stored(outcome: WriteOutcome) -> MemoryWriteOutcome:
    error = None
    if outcome.status != "applied":
        code = outcome.error_code or "INTERNAL_ERROR"
        error = WriteError(code=code, message=outcome.error_message or "", status=_ERROR_STATUS.get(code, 500))
    action = WriteAction(outcome.action) if outcome.action else None
    return MemoryWriteOutcome(
        write_id=outcome.write_id, action=action, entry_id=outcome.entry_id, score=outcome.score, error=error
    )


class WriteApplier:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        embed: Embed,
        embedding_model: str,
        consolidator_for: Callable[[MemoryWriteRequested], Consolidate | None] = lambda _event: None,
    ) -> None:
        self._sessions = sessions
        self._embed = embed
        self._embedding_model = embedding_model
        self._consolidator_for = consolidator_for

    async def apply(self, event: MemoryWriteRequested, embedding: list[float] | None = None) -> AppliedWrite:
        """Decide and apply one write. `embedding` may be precomputed by a batching caller."""
        digest = content_hash(event.content)
        try:
            if embedding is None and not await self._has_exact_copy(event.memory_id, digest):
                embedding = await self._embed_one(event.content)
            async with self._sessions.begin() as session:
                return await self._apply_locked(session, event, digest, embedding)
        except EmbeddingError as exc:
            return await self._record_failure(event, "EMBEDDING_UNAVAILABLE", str(exc))
        except MemoryGone:
            return await self._record_failure(event, "RESOURCE_NOT_FOUND", f"memory {event.memory_id} not found")

    async def _has_exact_copy(self, memory_id: str, digest: str) -> bool:
        async with self._sessions() as session:
            return await repo.find_exact_copy(session, memory_id, digest) is not None

    async def _embed_one(self, content: str) -> list[float]:
        return (await self._embed([content]))[0]

    async def _apply_locked(
        self, session: AsyncSession, event: MemoryWriteRequested, digest: str, embedding: list[float] | None
    ) -> AppliedWrite:
        await repo.lock_memory(session, event.memory_id)
        stored = await repo.get_write_outcome(session, event.write_id)
        if stored is not None and stored.status == "applied":
            return AppliedWrite(_stored(stored), None)

        memory = await session.get(Memory, event.memory_id)
        if memory is None or memory.project_id != event.project_id:
            # The memory was deleted after the API accepted the write (or the event names a foreign one).
            raise MemoryGone(event.memory_id)

        exact = await repo.find_exact_copy(session, event.memory_id, digest)
        if exact is None and embedding is None:
            embedding = await self._embed_one(event.content)  # the copy seen before the lock has gone since
        nearest = None if exact is not None else next(
            iter(await repo.find_nearest(session, event.memory_id, embedding or [])), None
        )
        incoming = IncomingWrite(
            content=event.content,
            duplicate_threshold=event.duplicate_threshold,
            policy=WritePolicy(memory.write_policy),
        )
        decision = await decide(
            incoming, exact_match=exact, nearest=nearest, consolidate=self._consolidator_for(event)
        )
        entry, change = await self._carry_out(session, event, decision, digest, embedding)
        outcome = WriteOutcome(
            write_id=event.write_id,
            project_id=event.project_id,
            memory_id=event.memory_id,
            status="applied",
            action=decision.action.value,
            entry_id=entry.id,
            score=decision.score,
            failed_attempts=stored.failed_attempts if stored else 0,
        )
        await repo.save_write_outcome(session, outcome)
        await repo.add_history(session, self._history(event, decision, entry, nearest))
        return AppliedWrite(_stored(outcome), change)

    async def _carry_out(
        self,
        session: AsyncSession,
        event: MemoryWriteRequested,
        decision: Decision,
        digest: str,
        embedding: list[float] | None,
    ) -> tuple[MemoryEntry, EntryChangeKind | None]:
        if decision.action is WriteAction.SKIPPED:
            assert decision.target is not None
            entry = await session.get(MemoryEntry, decision.target.entry_id)
            assert entry is not None
            return entry, None
        if decision.action is WriteAction.UPDATED:
            assert decision.target is not None and decision.merged_content is not None
            return await self._merge(session, event, decision.target.entry_id, decision.merged_content), (
                EntryChangeKind.UPDATED
            )
        assert embedding is not None
        entry = await repo.insert_entry(
            session,
            memory_id=event.memory_id,
            project_id=event.project_id,
            content=event.content,
            content_hash=digest,
            embedding=embedding,
            embedding_model=self._embedding_model,
            source_type=event.source_type.value,
            tags=event.tags,
            metadata_=event.metadata,
            source_generation_id=event.source_generation_id,
            source_conversation_id=event.source_conversation_id,
        )
        return entry, EntryChangeKind.CREATED

    async def _merge(
        self, session: AsyncSession, event: MemoryWriteRequested, entry_id: str, merged_content: str
    ) -> MemoryEntry:
        entry = await session.get(MemoryEntry, entry_id)
        assert entry is not None
        tags = list(entry.tags or [])
        tags += [tag for tag in event.tags or [] if tag not in tags]
        metadata = {**(entry.metadata_ or {}), **(event.metadata or {})}
        # Provenance stays that of the first assertion: a merge never rewrites it.
        return await repo.update_entry(
            session,
            entry,
            {
                "content": merged_content,
                "content_hash": content_hash(merged_content),
                "embedding": await self._embed_one(merged_content),
                "embedding_model": self._embedding_model,
                "tags": tags or None,
                "metadata_": metadata or None,
            },
        )

    @staticmethod
    def _history(
        event: MemoryWriteRequested, decision: Decision, entry: MemoryEntry, nearest: object
    ) -> EntryHistory:
        target = decision.target
        return EntryHistory(
            write_id=event.write_id,
            project_id=event.project_id,
            memory_id=event.memory_id,
            entry_id=entry.id,
            action=decision.action.value,
            rule=decision.rule,
            score=decision.score,
            candidate_ids=[target.entry_id] if target else None,
            model=event.agent.model if event.agent and decision.action is WriteAction.UPDATED else None,
            content_before=target.content if target and decision.action is WriteAction.UPDATED else None,
            content_after=entry.content if decision.action is not WriteAction.SKIPPED else event.content,
        )

    async def _record_failure(self, event: MemoryWriteRequested, code: str, message: str) -> AppliedWrite:
        """A failed attempt is stored (not as an effect) so a retry with the same key can try again."""
        async with self._sessions.begin() as session:
            stored = await repo.get_write_outcome(session, event.write_id)
            if stored is not None and stored.status == "applied":
                return AppliedWrite(_stored(stored), None)
            failure = WriteOutcome(
                write_id=event.write_id,
                project_id=event.project_id,
                memory_id=event.memory_id,
                status="failed",
                error_code=code,
                error_message=message,
                failed_attempts=(stored.failed_attempts if stored else 0) + 1,
                updated_at=datetime.now(UTC),
            )
            await repo.save_write_outcome(session, failure)
        return AppliedWrite(_stored(failure), None)


class MemoryGone(Exception):
    """The target memory does not exist (any more) in the event's project: the write cannot apply."""
