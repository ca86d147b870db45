"""Applying one write event: the writer's unit of work around `shared.decision.decide`.

Order matters: the embedding (the expensive part) is computed before the memory's lock is taken; inside
one transaction the lock is taken, the write id's stored outcome is reused if it exists, the decision is
made and applied, and the outcome and its audit record are stored with it. A redelivered event therefore
has one effect.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import func
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import registry
from shared import repository as repo
from shared.db.models import EntryHistory, Memory, MemoryEntry, WriteOutcome
from shared.decision import ARBITRATION_SHORTLIST, Candidate, Decision, IncomingWrite, decide
from shared.embeddings import EmbeddingError
from shared.events import (
    AgentContext,
    EntryChangeKind,
    MemoryWriteOutcome,
    MemoryWriteRequested,
    WriteAction,
    WriteError,
    WritePolicy,
)
from shared.guard import content_hash
from shared.llm import ARBITRATION_PROMPT_VERSION, MERGE_PROMPT_VERSION, ModelSteps

Embed = Callable[[Sequence[str]], Awaitable[list[list[float]]]]

_ERROR_STATUS = {"EMBEDDING_UNAVAILABLE": 503, "RESOURCE_NOT_FOUND": 404}


@dataclass(frozen=True, slots=True)
class AppliedWrite:
    outcome: MemoryWriteOutcome
    change: EntryChangeKind | None  # what the change feed announces; None for skips and replays
    superseded_entry_id: str | None = None
    replayed: bool = False  # the stored outcome of an earlier delivery: counted then, not again
    rejected: str | None = None  # why the event must be dead-lettered (it names another project's memory)


def outcome_of(record: WriteOutcome) -> MemoryWriteOutcome:
    error = None
    if record.status == "failed":
        code = record.error_code or "INTERNAL_ERROR"
        error = WriteError(code=code, message=record.error_message or "", status=_ERROR_STATUS.get(code, 500))
    return MemoryWriteOutcome(
        write_id=record.write_id,
        action=WriteAction(record.action) if record.action else None,
        entry_id=record.entry_id,
        score=record.score,
        error=error,
    )


@dataclass(frozen=True, slots=True)
class Written:
    """The entry a decision left in place: what the outcome and the audit record name."""

    id: str
    content: str


class MemoryGone(Exception):
    """The target memory does not exist (any more): the write cannot apply."""


class ForeignMemory(Exception):
    """The event names a memory of another project: never applied, whoever sent it."""


class WriteApplier:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        embed: Embed,
        embedding_model: str,
        *,
        default_model: str | None = None,
        llm_timeout: float = 30.0,
    ) -> None:
        self._sessions = sessions
        self._embed = embed
        self._embedding_model = embedding_model
        # Arbitration of writes that carry no agent (REST, orchestration) uses the service's own model.
        self._default_agent = AgentContext(model=default_model) if default_model else None
        self._llm_timeout = llm_timeout

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
        except ForeignMemory:
            # To the sender it is simply not found (no existence is revealed); to operators, a dead letter.
            failure = await self._record_failure(event, "RESOURCE_NOT_FOUND", f"memory {event.memory_id} not found")
            reason = f"write event of project {event.project_id} names a memory of another project"
            return AppliedWrite(failure.outcome, None, rejected=reason)

    async def _has_exact_copy(self, memory_id: str, digest: str) -> bool:
        async with self._sessions() as session:
            # A lone read needs no transaction: autocommit spares the BEGIN and ROLLBACK round trips.
            await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            return await repo.find_exact_copy(session, memory_id, digest) is not None

    async def _embed_one(self, content: str) -> list[float]:
        return (await self._embed([content]))[0]

    def _steps(self, event: MemoryWriteRequested, policy: WritePolicy) -> tuple[ModelSteps | None, ModelSteps | None]:
        """(merge steps, arbitration steps): merges only on agent paths; arbitration with any model."""
        merge = ModelSteps(event.agent, self._llm_timeout) if event.agent else None
        if policy is not WritePolicy.ARBITRATE:
            return merge, None
        agent = event.agent or self._default_agent
        return merge, ModelSteps(agent, self._llm_timeout) if agent else None

    async def _apply_locked(
        self, session: AsyncSession, event: MemoryWriteRequested, digest: str, embedding: list[float] | None
    ) -> AppliedWrite:
        await repo.lock_memory(session, event.memory_id)
        stored = await repo.get_write_outcome(session, event.write_id)
        if stored is not None and stored.status == "applied":
            return AppliedWrite(outcome_of(stored), None, replayed=True)

        memory = await session.get(Memory, event.memory_id)
        if memory is None:
            raise MemoryGone(event.memory_id)  # deleted after the API accepted the write
        if memory.project_id != event.project_id:
            raise ForeignMemory(event.memory_id)

        policy = event.write_policy or WritePolicy(memory.write_policy)
        exact = await repo.find_exact_copy(session, event.memory_id, digest)
        nearest: list[Candidate] = []
        if exact is None:
            if embedding is None:
                embedding = await self._embed_one(event.content)  # the copy seen before the lock has gone
            limit = ARBITRATION_SHORTLIST if policy is WritePolicy.ARBITRATE else 1
            nearest = await repo.find_nearest(session, event.memory_id, embedding, limit=limit)
        merge, arbitration = self._steps(event, policy)
        decision = await decide(
            IncomingWrite(content=event.content, duplicate_threshold=event.duplicate_threshold, policy=policy),
            exact_match=exact,
            nearest=nearest,
            consolidate=merge.consolidate if merge else None,
            arbitrate=arbitration.arbitrate if arbitration else None,
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
            updated_at=func.now(),
        )
        await repo.save_write_outcome(session, outcome)
        model_steps = arbitration if decision.rule.startswith("arbitrated") else merge
        await repo.add_history(session, _history(event, decision, entry, nearest, model_steps))
        for steps in {id(s): s for s in (merge, arbitration) if s}.values():
            for purpose, completion in steps.completions:
                await registry.add_usage(session, event.project_id, steps.agent.ai_provider_id, completion, purpose)
        superseded = decision.target.entry_id if decision.action is WriteAction.SUPERSEDED and decision.target else None
        return AppliedWrite(outcome_of(outcome), change, superseded)

    async def _carry_out(
        self,
        session: AsyncSession,
        event: MemoryWriteRequested,
        decision: Decision,
        digest: str,
        embedding: list[float] | None,
    ) -> tuple[Written, EntryChangeKind | None]:
        target = decision.target
        if decision.action is WriteAction.SKIPPED:
            assert target is not None
            return Written(target.entry_id, target.content), None
        if decision.action is WriteAction.UPDATED:
            assert target is not None and decision.merged_content is not None
            merged = await self._merge(session, event, target.entry_id, decision.merged_content)
            return Written(merged.id, merged.content), EntryChangeKind.UPDATED
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
        if decision.action is WriteAction.SUPERSEDED:
            assert target is not None
            # Retired, not rewritten: the old entry keeps its text and points at its replacement.
            await repo.invalidate_entry(session, target.entry_id, entry.id, datetime.now(UTC))
            return Written(entry.id, entry.content), EntryChangeKind.SUPERSEDED
        return Written(entry.id, entry.content), EntryChangeKind.CREATED

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

    async def _record_failure(self, event: MemoryWriteRequested, code: str, message: str) -> AppliedWrite:
        """A failed attempt is stored (not as an effect) so a retry with the same key can try again."""
        async with self._sessions.begin() as session:
            stored = await repo.get_write_outcome(session, event.write_id)
            if stored is not None and stored.status == "applied":
                return AppliedWrite(outcome_of(stored), None, replayed=True)
            failure = WriteOutcome(
                write_id=event.write_id,
                project_id=event.project_id,
                memory_id=event.memory_id,
                status="failed",
                error_code=code,
                error_message=message,
                failed_attempts=(stored.failed_attempts if stored else 0) + 1,
                updated_at=func.now(),
            )
            await repo.save_write_outcome(session, failure)
        return AppliedWrite(outcome_of(failure), None)


def _history(
    event: MemoryWriteRequested,
    decision: Decision,
    entry: Written,
    nearest: list[Candidate],
    model_steps: ModelSteps | None,
) -> EntryHistory:
    target = decision.target
    asked_model = decision.rule.startswith(("arbitrated", "merged"))
    prompt_version = None
    if asked_model:
        prompt_version = ARBITRATION_PROMPT_VERSION if decision.rule.startswith("arbitrated") else MERGE_PROMPT_VERSION
    changed_text = decision.action is WriteAction.UPDATED
    return EntryHistory(
        write_id=event.write_id,
        project_id=event.project_id,
        memory_id=event.memory_id,
        entry_id=entry.id,
        related_entry_id=target.entry_id if target and decision.action is WriteAction.SUPERSEDED else None,
        action=decision.action.value,
        rule=decision.rule,
        score=decision.score,
        candidate_ids=[c.entry_id for c in nearest] or ([target.entry_id] if target else None),
        model=model_steps.agent.model if model_steps and asked_model else None,
        prompt_version=prompt_version,
        content_before=target.content if target and changed_text else None,
        content_after=entry.content if decision.action is not WriteAction.SKIPPED else event.content,
    )
