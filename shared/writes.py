"""Applying write events: the writer's unit of work around `shared.decision.decide`.

Order matters: the embeddings (the expensive part) are computed before the memory's lock is taken; inside
one transaction the lock is taken, the write id's stored outcome is reused if it exists, the decision is
made and applied, and the outcome and its audit record are stored with it. A redelivered event therefore
has one effect.

A partition's queued events are applied as a batch (`prepare`, then `decide`, driven by the writer): one query
finds the exact copies, one model call embeds the rest, and one transaction decides them in order, so the serial
part of a write is its lookup, decision and insert. `apply` and `apply_batch` do both steps in one call (the
tests decide writes so, without a writer).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import Row
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import bus, registry, write_records
from shared import repository as repo
from shared.batching import Coalescer
from shared.db.models import MemoryEntry, WriteOutcome
from shared.decision import ARBITRATION_SHORTLIST, Candidate, Decision, IncomingWrite, Rule, decide
from shared.embeddings import EmbeddingError, cosine
from shared.events import (
    METADATA_MAX_BYTES,
    TAGS_MAX_COUNT,
    AgentContext,
    EntryChangeKind,
    EntryState,
    MemoryWriteOutcome,
    MemoryWriteRequested,
    WriteAction,
    WriteError,
    WritePolicy,
    distinct_tags,
    json_text,
)
from shared.guard import content_hash
from shared.llm import ARBITRATION_PROMPT_VERSION, MERGE_PROMPT_VERSION, ModelSteps
from shared.logs import log_context
from shared.write_records import HistoryRow, OutcomeRow

log = logging.getLogger("memories.writer")

Embed = Callable[[Sequence[str]], Awaitable[list[list[float]]]]

_ERROR_STATUS = {"EMBEDDING_UNAVAILABLE": 503, "RESOURCE_NOT_FOUND": 404}
REFUSED_FOR_NOW = frozenset(code for code, status in _ERROR_STATUS.items() if status == 503)
"""Failures that a retry of the same write may cure (a dependency was down); the others are for good."""


@dataclass(frozen=True, slots=True)
class Deferred:
    """A write a transaction that waits for nothing left undecided: its memory was busy (another transaction held
    it), or deciding it might have asked a model. It is to be decided later, in its order, by a caller that waits.
    Not an exception: a result among the failures that a retry or a dead letter is for, and never one of them."""

    memory_id: str
    why: str


@dataclass(frozen=True, slots=True)
class AppliedWrite:
    outcome: MemoryWriteOutcome
    change: EntryChangeKind | None  # what the change feed announces; None for skips and replays
    superseded_entry_id: str | None = None
    replayed: bool = False  # the stored outcome of an earlier delivery: counted then, not again
    rejected: str | None = None  # why the event must be dead-lettered (it names another project's memory)


StoredOutcome = WriteOutcome | OutcomeRow | Row[Any]
"""A write's record: an ORM object, a plain record or a row, all with the columns as attributes."""


def outcome_of(record: StoredOutcome) -> MemoryWriteOutcome:
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
class PreparedWrite:
    """A write ready for its transaction: its content hash and, unless a stored exact copy makes it
    needless, its embedding; or the failure that already ended it."""

    event: MemoryWriteRequested
    digest: str
    embedding: list[float] | None = None
    failed: AppliedWrite | None = None


@dataclass(frozen=True, slots=True)
class Written:
    """The entry a decision left in place: what the outcome and the audit record name."""

    id: str
    content: str


_POLICIES_REMEMBERED = 100_000


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
        # Partitions preparing at the same moment look their copies up in one query.
        self._stored_copies = Coalescer(self._exact_copies, max_batch=512)
        self._embedding_model = embedding_model
        # Arbitration of writes that carry no agent (REST, orchestration) uses the service's own model.
        self._default_agent = AgentContext(model=default_model) if default_model else None
        self._llm_timeout = llm_timeout
        # Each memory's policy as last decided here: whether its writes may wait on arbitration.
        self._arbitrating: OrderedDict[str, bool] = OrderedDict()  # least recently decided first

    def may_wait_on_a_model(self, prepared: PreparedWrite) -> bool:
        """Whether deciding this write may call a model: an agent's merge, or arbitration (by the write's own
        policy, else its memory's as last seen here; a memory not seen yet may arbitrate). The writer decides
        such a write, and its memory's later writes, aside in a transaction of their own, so that a slow model
        holds up no other memory."""
        event = prepared.event
        if prepared.embedding is None:  # an exact copy (skipped without asking), or a write failed already
            return False
        remembered = WritePolicy.ARBITRATE if self._arbitrating.get(event.memory_id, True) else WritePolicy.SEED
        return any(self._steps(event, event.write_policy or remembered))

    def _remember_policies(self, memories: dict[str, Any]) -> None:
        for memory_id, memory in memories.items():
            self._arbitrating[memory_id] = memory.write_policy == WritePolicy.ARBITRATE.value
            self._arbitrating.move_to_end(memory_id)
        while len(self._arbitrating) > _POLICIES_REMEMBERED:  # the least recently written is forgotten first
            self._arbitrating.popitem(last=False)

    async def embedder_answers(self) -> bool:
        """Whether the embedding model answers now (a failure that would recur counts as an answer: waiting would
        not cure it)."""
        try:
            await self._embed(["Is the embedding model back?"])
        except EmbeddingError as exc:
            return not exc.transient
        return True

    async def apply(self, event: MemoryWriteRequested) -> AppliedWrite:
        """Decide and apply one write."""
        (prepared,) = await self.prepare([event])
        if prepared.failed is not None:
            return prepared.failed
        applied = await self._apply_alone(prepared, defer_waits=False)
        assert isinstance(applied, AppliedWrite)
        return applied

    async def _apply_alone(self, prepared: PreparedWrite, *, defer_waits: bool) -> AppliedWrite | Deferred:
        """One write in its own transaction (`decide`'s `defer_waits`)."""
        memory_id = prepared.event.memory_id
        try:
            async with self._sessions.begin() as session:
                if defer_waits and await repo.lock_memories_unless_busy(session, [memory_id]):
                    return Deferred(memory_id, "busy")
                (decided,) = await self._decide_batch(session, [prepared], defer_waits=defer_waits)
                if isinstance(decided, Deferred):
                    return decided
                await self._store(session, [decided])
                return decided.applied
        except EmbeddingError as exc:  # a model's rewrite checked or embedded, or an exact copy gone since
            if exc.transient:  # an outage: waited out by the caller, and the write decided after it
                raise
            return await self.record_failure(prepared.event, "EMBEDDING_UNAVAILABLE", str(exc))

    async def apply_batch(self, events: Sequence[MemoryWriteRequested]) -> list[AppliedWrite | Deferred | Exception]:
        """`prepare`, then `decide`: one exact-copy query, one embedding call, one transaction."""
        return await self.decide(await self.prepare(events))

    async def prepare(self, events: Sequence[MemoryWriteRequested]) -> list[PreparedWrite]:
        """What can be done before any lock: find the exact copies (one query) and embed the other texts
        (one call). An embedding that failed for good ends its write here, stored as failed; one that may pass
        (`EmbeddingError.transient`) is raised, an outage to wait out: the write's caller may have been told that
        it will be applied (a 202), so it must not fail for a provider's bad minute."""
        digests = [content_hash(event.content) for event in events]
        copies = await self._stored_copies([(e.memory_id, d) for e, d in zip(events, digests, strict=True)])
        unseen = [i for i, copy in enumerate(copies) if copy is None]
        prepared = [PreparedWrite(event, digest) for event, digest in zip(events, digests, strict=True)]
        if not unseen:
            return prepared
        try:
            vectors = await self._embed([events[i].content for i in unseen])
        except EmbeddingError as exc:
            if exc.transient:
                raise
            for i in unseen:
                failed = await self.record_failure(events[i], "EMBEDDING_UNAVAILABLE", str(exc))
                prepared[i] = PreparedWrite(events[i], digests[i], failed=failed)
        else:
            for i, vector in zip(unseen, vectors, strict=True):
                prepared[i] = PreparedWrite(events[i], digests[i], vector)
        return prepared

    async def decide(
        self, prepared: Sequence[PreparedWrite], *, defer_waits: bool = False
    ) -> list[AppliedWrite | Deferred | Exception]:
        """Decide prepared writes in their order, in one transaction.

        Each gets its result, or the exception that stopped it (the caller retries that one). When a write
        spoils the shared transaction, each is applied alone, so only that write fails and the others are
        not held back by it; an outage met on the way stops the others too (they get its exception), so that
        what is decided is always a prefix, in order. With `defer_waits`, a write that would wait, for a memory
        another transaction holds, for a generation or conversation being forgotten, or on a model, is left
        undecided (`Deferred`), and so are its memory's later writes: one memory holds up no other.
        """
        # One result per prepared write, in its place: the failure it came with, its decision, or its deferral.
        results: list[AppliedWrite | Deferred | Exception | None] = [one.failed for one in prepared]
        ready = [i for i, one in enumerate(prepared) if one.failed is None]
        if not ready:
            return [one.failed for one in prepared if one.failed is not None]
        busy: set[str] = set()
        try:
            async with self._sessions.begin() as session:
                if defer_waits:
                    busy = await repo.lock_memories_unless_busy(session, [prepared[i].event.memory_id for i in ready])
                free = [i for i in ready if prepared[i].event.memory_id not in busy]
                together = await self._decide_batch(session, [prepared[i] for i in free], defer_waits=defer_waits)
                await self._store(session, [one for one in together if isinstance(one, Decided)])
            for i, one in zip(free, together, strict=True):
                results[i] = one if isinstance(one, Deferred) else one.applied
        except Exception as failure:  # noqa: BLE001 - the culprit shows when each write is applied alone
            # An outage would only be met again by each write alone (a hung embedder, once per write): all wait it out.
            outage: Exception | None = failure if bus.is_outage(failure) else None
            for i in ready:
                memory_id = prepared[i].event.memory_id
                # Past an outage, none is tried, and past a deferred write none of its memory's: a later write must
                # not be decided before an earlier one.
                if memory_id in busy:
                    results[i] = Deferred(memory_id, "an earlier write of its memory was deferred")
                    continue
                try:
                    result = outage or await self._apply_alone(prepared[i], defer_waits=defer_waits)
                except Exception as exc:  # noqa: BLE001 - handed to the caller, which retries or dead-letters it
                    result = exc
                if isinstance(result, Deferred):
                    busy.add(memory_id)
                elif outage is None and isinstance(result, Exception) and bus.is_outage(result):
                    outage = result
                results[i] = result
        return [
            Deferred(one.event.memory_id, "busy") if result is None else result
            for one, result in zip(prepared, results, strict=True)
        ]

    async def _decide_batch(
        self, session: AsyncSession, batch: Sequence[PreparedWrite], *, defer_waits: bool
    ) -> list[Decided | Deferred]:
        """The writes decided in order under their memories' locks; with `defer_waits` the caller took the locks,
        and a write that might ask a model is deferred with its memory's later writes."""
        if not batch:
            return []
        if not defer_waits:
            await repo.lock_memories(session, [one.event.memory_id for one in batch])
        batch, being_forgotten = await _forget_forgotten(session, batch, wait=not defer_waits)
        events = [one.event for one in batch]
        # Read once for the batch, under the locks: only this transaction changes these records meanwhile.
        stored = await write_records.get_write_outcomes(session, [event.write_id for event in events])
        memories = await repo.load_memories(session, [event.memory_id for event in events])
        self._remember_policies(memories)
        copies = ExactCopies(await repo.find_exact_copies(session, [(one.event.memory_id, one.digest) for one in batch]))
        decided: list[Decided | Deferred] = []
        earlier: dict[str, Decided] = {}
        deferred: set[str] = set()
        for one in batch:
            event = one.event
            if event.memory_id in deferred:
                decided.append(Deferred(event.memory_id, "an earlier write of its memory was deferred"))
                continue
            if being_forgotten.intersection(_references(event)):
                # The forgetting holds its lock, or waits for it: the transaction every partition shares must not.
                decided.append(Deferred(event.memory_id, "a generation or conversation it cites is being forgotten"))
                deferred.add(event.memory_id)
                continue
            if event.write_id in earlier:  # the same write delivered twice in one batch: one effect
                outcome = earlier[event.write_id].applied.outcome
                decided.append(Decided(AppliedWrite(outcome, None, replayed=True)))
                continue
            # Lines logged while deciding it (a model's failure, say) name the write, whichever task runs the batch.
            with log_context(write_id=event.write_id, memory_id=event.memory_id):
                result = await self._decide_locked(
                    session, event, one.digest, one.embedding, stored.get(event.write_id), memories.get(event.memory_id),
                    copies, models_allowed=not defer_waits,
                )
            if isinstance(result, Deferred):
                deferred.add(event.memory_id)
            else:
                earlier[event.write_id] = result
            decided.append(result)
        # The entries as the batch leaves them go with the outcomes, so a waiting caller need not read them back.
        named = [one.applied.outcome.entry_id for one in decided if isinstance(one, Decided) and not one.applied.outcome.error]
        states = await repo.get_entry_states(session, [entry_id for entry_id in named if entry_id])
        return [one.with_entry(states) if isinstance(one, Decided) else one for one in decided]

    async def _exact_copies(self, keys: Sequence[tuple[str, str]]) -> list[Candidate | None]:
        """The valid entry of each (memory id, content hash) pair, if it has one: those need no embedding."""
        async with self._sessions() as session:
            # A lone read needs no transaction: autocommit spares the BEGIN and ROLLBACK round trips.
            await session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
            found = await repo.find_exact_copies(session, keys)
        return [found.get(key) for key in keys]

    async def _embed_one(self, content: str) -> list[float]:
        return (await self._embed([content]))[0]

    async def _relatedness(self, vectors: dict[str, list[float]], text: str, facts: list[str]) -> list[float]:
        """How a model's rewrite is checked against the facts it rewrites (asked only when there is one).
        `vectors` holds the texts embedded already (the incoming fact's); the rewrite's is kept there for
        the entry it becomes, so nothing is embedded twice while the memory is locked."""
        missing = [t for t in dict.fromkeys([text, *facts]) if t not in vectors]
        if missing:
            vectors.update(zip(missing, await self._embed(missing), strict=True))
        return [cosine(vectors[text], vectors[fact]) for fact in facts]

    def _steps(self, event: MemoryWriteRequested, policy: WritePolicy) -> tuple[ModelSteps | None, ModelSteps | None]:
        """(merge steps, arbitration steps): merges only on agent paths; arbitration with any model."""
        merge = ModelSteps(event.agent, self._llm_timeout) if event.agent else None
        if policy is not WritePolicy.ARBITRATE:
            return merge, None
        agent = event.agent or self._default_agent
        return merge, ModelSteps(agent, self._llm_timeout) if agent else None

    async def _decide_locked(
        self,
        session: AsyncSession,
        event: MemoryWriteRequested,
        digest: str,
        embedding: list[float] | None,
        stored: StoredOutcome | None,
        memory: Row[Any] | None,
        copies: ExactCopies,
        *,
        models_allowed: bool,
    ) -> Decided | Deferred:
        """Decide one write and carry it out; the caller holds the memory's lock and stores the records. Unless
        `models_allowed`, a write whose decision might ask a model is deferred instead (the writer routes those to
        a transaction of their own, but from what it saw before the lock: a memory's policy changed since, an
        exact copy gone)."""
        if stored is not None and stored.status == "applied":
            return Decided(AppliedWrite(outcome_of(stored), None, replayed=True))

        if memory is None:  # deleted after the API accepted the write
            return _failure(event, stored, "RESOURCE_NOT_FOUND", f"memory {event.memory_id} not found")
        if memory.project_id != event.project_id:
            # To the sender it is simply not found (no existence is revealed); to operators, a dead letter.
            failed = _failure(event, stored, "RESOURCE_NOT_FOUND", f"memory {event.memory_id} not found")
            reason = f"write event of project {event.project_id} names a memory of another project"
            return Decided(AppliedWrite(failed.applied.outcome, None, rejected=reason), failed.record)

        policy = event.write_policy or WritePolicy(memory.write_policy)
        exact = copies.get(event.memory_id, digest)
        merge, arbitration = self._steps(event, policy)
        if exact is None and not models_allowed and (merge or arbitration):
            return Deferred(event.memory_id, "its decision may ask a model")
        if exact is None and embedding is None and not models_allowed:
            # The copy seen before the lock has gone (edited, deleted, merged): embedding it here would hold every
            # memory of the shared transaction for as long as the embedder takes.
            return Deferred(event.memory_id, "its exact copy has gone: it is to be embedded")
        nearest: list[Candidate] = []
        if exact is None:
            if embedding is None:
                embedding = await self._embed_one(event.content)  # the copy seen before the lock has gone (a lane)
            limit = ARBITRATION_SHORTLIST if policy is WritePolicy.ARBITRATE else 1
            nearest = await repo.find_nearest(session, event.memory_id, embedding, limit=limit)
        vectors = {event.content: embedding} if embedding is not None else {}
        try:
            decision = await decide(
                IncomingWrite(content=event.content, duplicate_threshold=event.duplicate_threshold, policy=policy),
                exact_match=exact,
                nearest=nearest,
                consolidate=merge.consolidate if merge else None,
                arbitrate=arbitration.arbitrate if arbitration else None,
                relatedness=partial(self._relatedness, vectors),
            )
        finally:
            await self._meter(event.project_id, merge, arbitration)
        if decision.action is WriteAction.UPDATED:
            decision = await _unless_held_already(session, event.memory_id, decision)
        entry, change = await self._carry_out(session, event, decision, digest, embedding, vectors)
        copies.record(event.memory_id, decision, entry)
        record = OutcomeRow(
            write_id=event.write_id,
            project_id=event.project_id,
            memory_id=event.memory_id,
            status="applied",
            action=decision.action.value,
            entry_id=entry.id,
            score=decision.score,
            failed_attempts=stored.failed_attempts if stored else 0,
        )
        model_steps = arbitration if _model_step(decision.rule) == "arbitration" else merge
        superseded = decision.target.entry_id if decision.action is WriteAction.SUPERSEDED and decision.target else None
        return Decided(
            AppliedWrite(outcome_of(record), change, superseded),
            record,
            _history(event, decision, entry, nearest, model_steps),
        )

    async def _meter(self, project_id: str, *asked: ModelSteps | None) -> None:
        """The tokens of the model calls a decision made (`registry.record_usage`: before the decision's own
        transaction ends, which may still fail). With the database down at that moment they are logged and not
        stored (the metrics have them): metering fails no write."""
        spent = [
            registry.Spent(steps.agent.ai_provider_id, purpose, completion)
            for steps in {id(s): s for s in asked if s}.values()
            for purpose, completion in steps.completions
        ]
        try:
            await registry.record_usage(self._sessions, project_id, spent)
        except Exception as exc:  # noqa: BLE001 - metering fails no write; the metrics counted the tokens already
            log.warning("the usage of %d model calls could not be stored: %s", len(spent), exc)

    @staticmethod
    async def _store(session: AsyncSession, decided: Sequence[Decided]) -> None:
        """The batch's outcomes and its audit records, in one statement."""
        outcomes = [one.record for one in decided if one.record is not None]
        await write_records.save_records(session, outcomes, [one.history for one in decided if one.history is not None])

    async def _carry_out(
        self,
        session: AsyncSession,
        event: MemoryWriteRequested,
        decision: Decision,
        digest: str,
        embedding: list[float] | None,
        vectors: dict[str, list[float]],
    ) -> tuple[Written, EntryChangeKind | None]:
        target = decision.target
        if decision.action is WriteAction.SKIPPED:
            assert target is not None
            return Written(target.entry_id, target.content), None
        if decision.action is WriteAction.UPDATED:
            assert target is not None and decision.merged_content is not None
            merged = await self._merge(session, event, target.entry_id, decision.merged_content, vectors)
            return Written(merged.id, merged.content), EntryChangeKind.UPDATED
        assert embedding is not None
        retired = None
        if decision.action is WriteAction.SUPERSEDED:
            assert target is not None
            retired = await session.get(MemoryEntry, target.entry_id)
            assert retired is not None
        # A replacement states the same subject, so it keeps the retired entry's labels: a search filtered
        # by them must find what holds now.
        # No tags and no metadata are stored as none, however sent ([] and {} too), as an edit stores them.
        tags, metadata = _labels_taken_over(retired, event) if retired else (event.tags or None, event.metadata or None)
        entry_id = await repo.insert_entry(
            session,
            memory_id=event.memory_id,
            project_id=event.project_id,
            content=event.content,
            content_hash=digest,
            embedding=embedding,
            embedding_model=self._embedding_model,
            source_type=event.source_type.value,
            tags=tags,
            metadata_=metadata,
            source_generation_id=event.source_generation_id,
            source_conversation_id=event.source_conversation_id,
        )
        if retired is not None:
            # Retired, not rewritten: the old entry keeps its text and points at its replacement.
            await repo.invalidate_entry(session, retired.id, entry_id)
            return Written(entry_id, event.content), EntryChangeKind.SUPERSEDED
        return Written(entry_id, event.content), EntryChangeKind.CREATED

    async def _merge(
        self,
        session: AsyncSession,
        event: MemoryWriteRequested,
        entry_id: str,
        merged_content: str,
        vectors: dict[str, list[float]],
    ) -> MemoryEntry:
        entry = await session.get(MemoryEntry, entry_id)
        assert entry is not None
        tags, metadata = _labels_taken_over(entry, event)
        # Provenance stays that of the first assertion: a merge never rewrites it.
        return await repo.update_entry(
            session,
            entry,
            {
                "content": merged_content,
                "content_hash": content_hash(merged_content),
                # Embedded when the rewrite was checked, unless no check was made.
                "embedding": vectors.get(merged_content) or await self._embed_one(merged_content),
                "embedding_model": self._embedding_model,
                "tags": tags,
                "metadata_": metadata,
            },
        )

    async def record_failure(self, event: MemoryWriteRequested, code: str, message: str) -> AppliedWrite:
        """A failed attempt is stored (not as an effect) so a retry with the same key can try again."""
        async with self._sessions.begin() as session:
            # Under the memory's lock, like a decision: another delivery of this write applying it meanwhile
            # must not be overwritten by this failure (a later retry would then apply it twice).
            await repo.lock_memory(session, event.memory_id)
            stored = await write_records.get_write_outcome(session, event.write_id)
            if stored is not None and stored.status == "applied":
                return AppliedWrite(outcome_of(stored), None, replayed=True)
            failed = _failure(event, stored, code, message)
            await self._store(session, [failed])
        return failed.applied

    async def fail_pending(self, write_id: str, memory_id: str, code: str, message: str) -> bool:
        """Record as failed a write known only by its ids (its event could not be read); see
        `write_records.fail_pending_write`. No memory lock: the one UPDATE waits for the row lock of a transaction
        storing the write's outcome, then finds it no longer pending."""
        async with self._sessions.begin() as session:
            return await write_records.fail_pending_write(session, write_id, memory_id, code, message)


class ExactCopies:
    """The valid entries of a batch's (memory, content hash) pairs, read once under the locks and kept up to
    date as the batch's own decisions create, rewrite and retire entries."""

    def __init__(self, found: dict[tuple[str, str], Candidate]) -> None:
        self._found = found

    def get(self, memory_id: str, digest: str) -> Candidate | None:
        return self._found.get((memory_id, digest))

    def record(self, memory_id: str, decision: Decision, entry: Written) -> None:
        target = decision.target
        if target is not None and decision.action in (WriteAction.UPDATED, WriteAction.SUPERSEDED):
            old_key = (memory_id, content_hash(target.content))
            if (copy := self._found.get(old_key)) is not None and copy.entry_id == target.entry_id:
                del self._found[old_key]  # rewritten or retired: no longer a copy of its old text
        if decision.action is not WriteAction.SKIPPED:
            self._found.setdefault((memory_id, content_hash(entry.content)), Candidate(entry.id, entry.content, 1.0))


@dataclass(frozen=True, slots=True)
class Decided:
    """One write decided inside a transaction: its result and the records to store with it."""

    applied: AppliedWrite
    record: OutcomeRow | None = None  # None for a replay: its record is stored already
    history: HistoryRow | None = None

    def with_entry(self, states: dict[str, EntryState]) -> Decided:
        outcome = self.applied.outcome
        state = states.get(outcome.entry_id) if outcome.entry_id and outcome.error is None else None
        if state is None:
            return self
        return replace(self, applied=replace(self.applied, outcome=outcome.model_copy(update={"entry": state})))


async def _forget_forgotten(
    session: AsyncSession, batch: Sequence[PreparedWrite], *, wait: bool
) -> tuple[Sequence[PreparedWrite], set[repo.ProvenanceRef]]:
    """The batch with the generations and conversations forgotten since its writes cited them left out of
    their new entries' provenance; the others are share-locked until the batch commits
    (`repository.hold_provenance`). Without `wait`, also the references being forgotten right now, not locked."""
    references = [_references(one.event) for one in batch]
    forgotten, busy = await repo.hold_provenance(session, [ref for refs in references for ref in refs], wait=wait)
    if not forgotten:
        return batch, busy
    kept = []
    for one, refs in zip(batch, references, strict=True):
        seen_at = one.event.sources_seen_at or one.event.occurred_at
        cleared = {f"source_{ref[1]}_id": None for ref in refs if ref in forgotten and _forgotten_for(ref, seen_at, forgotten[ref])}
        kept.append(replace(one, event=one.event.model_copy(update=cleared)) if cleared else one)
    return kept, busy


async def _unless_held_already(session: AsyncSession, memory_id: str, decision: Decision) -> Decision:
    """A rewrite (a merge, an arbitrated update) into the text a valid entry of the memory holds changes nothing
    (the target's own text), or would make the rewritten entry an exact copy of another: the write is skipped
    against that entry instead (the fact it brought is stored there already, as for any exact copy), and the entry
    the model would have rewritten stays as it was."""
    assert decision.target is not None and decision.merged_content is not None
    found = await repo.find_exact_copies(session, [(memory_id, content_hash(decision.merged_content))])
    holder = next(iter(found.values()), None)
    if holder is None:
        return decision
    return Decision(WriteAction.SKIPPED, f"{decision.rule}:{Rule.EXACT_COPY}", holder)


def _forgotten_for(reference: repo.ProvenanceRef, seen_at: datetime, forgotten_at: datetime) -> bool:
    """A generation is one turn: forgotten, it stays forgotten. A conversation goes on after "clear history" under
    the same id: what cites it after the forgetting keeps it."""
    return reference[1] == "generation" or seen_at <= forgotten_at


def _references(event: MemoryWriteRequested) -> list[repo.ProvenanceRef]:
    pairs = (("generation", event.source_generation_id), ("conversation", event.source_conversation_id))
    return [(event.project_id, kind, value) for kind, value in pairs if value]


def _labels_taken_over(
    entry: MemoryEntry, event: MemoryWriteRequested
) -> tuple[list[str] | None, dict[str, Any] | None]:
    """The tags and metadata of an entry that a write merges into or replaces: the entry's tags, then the
    write's new ones; the entry's metadata, the write's values winning. Within a write's own limits, or the entry
    could not be sent back as it is served (an edit is held to them): the write's new tags while they fit under
    TAGS_MAX_COUNT, and past METADATA_MAX_BYTES the write's metadata with the entry's other keys while they fit."""
    tags = distinct_tags([*(entry.tags or []), *(event.tags or [])])[:TAGS_MAX_COUNT]
    metadata = {**(entry.metadata_ or {}), **(event.metadata or {})}
    if len(json_text(metadata).encode()) > METADATA_MAX_BYTES:
        metadata = dict(event.metadata or {})
        for key, value in (entry.metadata_ or {}).items():
            if key not in metadata and len(json_text({**metadata, key: value}).encode()) <= METADATA_MAX_BYTES:
                metadata[key] = value
    return tags or None, metadata or None


def _failure(event: MemoryWriteRequested, stored: StoredOutcome | None, code: str, message: str) -> Decided:
    record = OutcomeRow(
        write_id=event.write_id,
        project_id=event.project_id,
        memory_id=event.memory_id,
        status="failed",
        error_code=code,
        error_message=message,
        failed_attempts=(stored.failed_attempts if stored else 0) + 1,
    )
    return Decided(AppliedWrite(outcome_of(record), None), record)


def _model_step(rule: str) -> str | None:
    """The model step the audit names: the last the decision went through, whether its answer was used or not
    ("merge_failed" asked the model too). A rule names its fallbacks ("arbitration_failed:merged")."""
    for step in reversed(rule.split(":")):
        if step in (Rule.MERGED, Rule.MERGE_FAILED):
            return "merge"
        if step in (Rule.ARBITRATED, Rule.ARBITRATION_FAILED):
            return "arbitration"
    return None


def _history(
    event: MemoryWriteRequested,
    decision: Decision,
    entry: Written,
    nearest: list[Candidate],
    model_steps: ModelSteps | None,
) -> HistoryRow:
    target = decision.target
    step = _model_step(decision.rule)
    prompt_version = {"arbitration": ARBITRATION_PROMPT_VERSION, "merge": MERGE_PROMPT_VERSION}.get(step or "")
    changed_text = decision.action is WriteAction.UPDATED
    return HistoryRow(
        write_id=event.write_id,
        project_id=event.project_id,
        memory_id=event.memory_id,
        entry_id=entry.id,
        related_entry_id=target.entry_id if target and decision.action is WriteAction.SUPERSEDED else None,
        action=decision.action.value,
        rule=decision.rule,
        score=decision.score,
        candidate_ids=[c.entry_id for c in nearest] or ([target.entry_id] if target else None),
        model=model_steps.agent.model if model_steps and step else None,
        prompt_version=prompt_version,
        content_before=target.content if target and changed_text else None,
        content_after=entry.content if decision.action is not WriteAction.SKIPPED else event.content,
    )
