"""A partition's queued writes decided as one batch (shared.writes.WriteApplier.apply_batch), against the
real database: one embedding call for the texts that need one, decisions in order within the batch, one
effect per write id, and a write that spoils the batch failing alone."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import zlib
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import httpx
import nats
import numpy as np
import pytest
from sqlalchemy import event, select
from sqlalchemy.exc import DataError, OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.writer.handler import PreparedBatch, WriteHandler
from services.writer.partitions import PartitionConsumer
from shared import bus, metrics, write_records
from shared import repository as repo
from shared import writes as writes_module
from shared.batching import Coalescer
from shared.db.models import EntryHistory, LlmUsage, MemoryEntry, WriteOutcome
from shared.embeddings import LOCAL_MODEL, EmbeddingError
from shared.events import AgentContext, MemoryWriteOutcome, MemoryWriteRequested, WriteAction, WritePolicy
from shared.ids import new_write_id
from shared.llm import ModelSteps
from shared.logs import ContextFilter, log_context
from shared.scripted_llm import ScriptedLLM
from shared.settings import Settings
from shared.writes import AppliedWrite, Deferred, PreparedWrite, WriteApplier
from tests.conftest import local_embed, wait_until_blocked_by
from tests.test_agent_paths import EMAIL, EMAIL_DETAIL, MERGED


class CountingEmbedder:
    """Unrelated texts get unrelated unit vectors; every call is recorded."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        self.calls.append(list(texts))
        vectors = []
        for text in texts:
            rng = random.Random(zlib.crc32(text.encode()))
            vector = [rng.gauss(0, 1) for _ in range(384)]
            norm = sum(x * x for x in vector) ** 0.5
            vectors.append([x / norm for x in vector])
        return vectors


async def new_memory(client: httpx.AsyncClient, project: dict[str, Any], name: str) -> dict[str, Any]:
    return (await client.post("/memories", json={"project_id": project["id"], "name": name})).json()


def write(memory: dict[str, Any], content: str, write_id: str | None = None, **fields: Any) -> MemoryWriteRequested:
    return MemoryWriteRequested(
        event_id=write_id or new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content=content,
        **fields,
    )


def actions(results: Sequence[AppliedWrite | Exception]) -> list[str | None]:
    return [r.outcome.action.value if isinstance(r, AppliedWrite) and r.outcome.action else repr(r) for r in results]


async def valid_contents(sessions: async_sessionmaker[AsyncSession], memory_id: str) -> list[str]:
    async with sessions() as session:
        rows = await session.scalars(
            select(MemoryEntry.content)
            .where(MemoryEntry.memory_id == memory_id, MemoryEntry.invalidated_at.is_(None))
            .order_by(MemoryEntry.created_at, MemoryEntry.id)
        )
        return list(rows)


async def test_a_batch_is_decided_in_order_with_one_embedding_call(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    first = await new_memory(client, project, "first")
    second = await new_memory(client, project, "second")
    embedder = CountingEmbedder()
    applier = WriteApplier(sessions, embedder, "counting")
    assert actions(await applier.apply_batch([write(first, "Ada prefers tea")])) == ["created"]
    assert len(embedder.calls) == 1

    repeated = write(second, "Bob uses Linux")
    batch = [
        write(first, "ada prefers TEA."),  # an exact copy (normalised) of a stored entry: no embedding
        write(first, "Ada lives in Paris"),
        repeated,
        write(second, "Bob uses Linux"),  # a copy of a write earlier in this very batch
        repeated,  # the same write delivered twice: one effect
        write(first, "Ada lives in Paris!"),
    ]
    results = await applier.apply_batch(batch)
    assert actions(results) == ["skipped", "created", "created", "skipped", "created", "skipped"]
    assert isinstance(results[4], AppliedWrite) and results[4].replayed
    assert results[4].outcome == results[2].outcome  # type: ignore[union-attr]
    # One call for the batch, without the text that had a stored exact copy.
    assert len(embedder.calls) == 2 and "ada prefers TEA." not in embedder.calls[1]
    assert await valid_contents(sessions, first["id"]) == ["Ada prefers tea", "Ada lives in Paris"]
    assert await valid_contents(sessions, second["id"]) == ["Bob uses Linux"]
    async with sessions() as session:
        outcomes = {o.write_id: o for o in await session.scalars(
            select(WriteOutcome).where(WriteOutcome.write_id.in_([e.write_id for e in batch]))
        )}
        audited = list(await session.scalars(
            select(EntryHistory.write_id).where(EntryHistory.write_id.in_([e.write_id for e in batch]))
        ))
    assert len(outcomes) == 5 and all(o.status == "applied" for o in outcomes.values())
    assert sorted(audited) == sorted({e.write_id for e in batch})  # one audit record per write, not per delivery


async def test_a_stored_text_is_an_exact_copy_in_its_own_memory_only(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    first = await new_memory(client, project, "first")
    second = await new_memory(client, project, "second")
    embedder = CountingEmbedder()
    applier = WriteApplier(sessions, embedder, "counting")
    assert actions(await applier.apply_batch([write(first, "Cy plays chess")])) == ["created"]
    batch = [write(second, "Cy plays chess"), write(first, "Cy plays chess"), write(first, "Cy plays go")]
    assert actions(await applier.apply_batch(batch)) == ["created", "skipped", "created"]
    assert embedder.calls[-1] == ["Cy plays chess", "Cy plays go"]  # only the copy in `first` needs none
    assert await valid_contents(sessions, second["id"]) == ["Cy plays chess"]


async def test_partitions_preparing_together_look_their_copies_up_in_one_query(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    first = await new_memory(client, project, "first")
    second = await new_memory(client, project, "second")
    embedder = CountingEmbedder()
    applier = WriteApplier(sessions, embedder, "counting")
    assert actions(await applier.apply_batch([write(first, "Dee likes jazz"), write(second, "Eve likes rock")])) == [
        "created", "created"
    ]
    lookups: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if "DISTINCT ON" in statement:
            lookups.append(statement)

    engine = sessions.kw["bind"].sync_engine
    event.listen(engine, "before_cursor_execute", count)
    try:
        prepared = await asyncio.gather(
            applier.prepare([write(first, "Dee likes jazz"), write(first, "Dee likes folk")]),
            applier.prepare([write(second, "Eve likes rock")]),
            applier.prepare([write(second, "Eve likes pop")]),
        )
    finally:
        event.remove(engine, "before_cursor_execute", count)
    assert len(lookups) == 1
    # Each partition still gets its own answer: only the stored copies go without an embedding.
    assert [[one.embedding is None for one in batch] for batch in prepared] == [[True, False], [True], [False]]


async def test_coalesced_calls_never_split_a_callers_items() -> None:
    # A partition's writes split over two decisions would have the later ones decided in a call of their own,
    # maybe before an earlier one the first call deferred (its memory busy) or an outage stopped.
    calls: list[list[str]] = []
    release = asyncio.Event()

    async def call_batch(items: list[str]) -> list[str]:
        calls.append(items)
        await release.wait()
        return [item.upper() for item in items]

    coalesced = Coalescer(call_batch, max_batch=4)
    first = asyncio.create_task(coalesced(["a"]))  # in the first call; the others queue up behind it
    await asyncio.sleep(0)
    queued = [asyncio.create_task(coalesced(items)) for items in (["b", "c"], ["d", "e", "f"], ["g"], list("hijkl"))]
    await asyncio.sleep(0)
    release.set()
    assert [await task for task in (first, *queued)] == [["A"], ["B", "C"], ["D", "E", "F"], ["G"], list("HIJKL")]
    assert calls == [["a"], ["b", "c"], ["d", "e", "f", "g"], list("hijkl")]  # whole callers, at most 4 unless one is more


async def test_a_coalesced_call_answering_too_few_results_fails_its_callers_and_not_the_next_ones() -> None:
    # The count was checked outside the call's failure handling: its callers waited for ever, and so did later ones.
    async def call_batch(items: list[str]) -> list[str]:
        return [item.upper() for item in items][: 1 if "short" in items else None]

    coalesced = Coalescer(call_batch)
    with pytest.raises(ValueError, match="1 results for 2 items"):
        await asyncio.wait_for(coalesced(["short", "answer"]), 5)
    assert await asyncio.wait_for(coalesced(["next"]), 5) == ["NEXT"]


async def test_the_coalesced_calls_worker_does_not_log_as_its_first_caller() -> None:
    # It serves every caller: its lines carried the write id of the caller that happened to start it.
    seen: list[str | None] = []

    async def call_batch(items: list[str]) -> list[str]:
        record = logging.LogRecord("memories.writer", logging.INFO, __file__, 0, "embedding", None, None)
        ContextFilter().filter(record)  # what stamps every handled line with the context's fields
        seen.append(getattr(record, "write_id", None))
        return items

    coalesced = Coalescer(call_batch)
    with log_context(write_id="wr_first_caller"):
        assert await coalesced(["a"]) == ["a"]
    assert seen == [None]


async def test_each_outcome_carries_its_entry_as_the_batch_left_it(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The reply carries the entry, so the API answers without reading it back."""
    memory = await new_memory(client, project, "states")
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    tagged = write(memory, "Fay owns a boat").model_copy(update={"tags": ["boats"], "metadata": {"k": 1}})
    created, skipped = await applier.apply_batch([tagged, write(memory, "fay owns a BOAT.")])
    assert isinstance(created, AppliedWrite) and isinstance(skipped, AppliedWrite)
    entry = created.outcome.entry
    assert entry is not None and entry.id == created.outcome.entry_id
    assert (entry.content, entry.tags, entry.metadata, entry.invalidated_at) == ("Fay owns a boat", ["boats"], {"k": 1}, None)
    assert skipped.outcome.entry == entry  # a skip answers with the entry it kept
    async with sessions() as session:
        assert (await repo.get_entry_states(session, [entry.id]))[entry.id] == entry
    assert MemoryWriteOutcome.model_validate_json(created.outcome.model_dump_json()) == created.outcome


async def test_a_vector_is_bound_in_binary_and_stored_and_compared_as_given(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The embedding column's type hands psycopg a float32 array (binary form), not text."""
    memory = await new_memory(client, project, "vectors")
    [vector, other] = await CountingEmbedder()(["a stored fact", "an unrelated one"])
    bound: list[Any] = []

    def capture(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        if statement.startswith("INSERT INTO memory_entries"):
            bound.append(parameters["embedding"])

    engine = sessions.kw["bind"].sync_engine
    event.listen(engine, "before_cursor_execute", capture)
    try:
        async with sessions.begin() as session:
            entry_id = await repo.insert_entry(
                session, memory_id=memory["id"], project_id=project["id"], content="a stored fact",
                content_hash="h", embedding=vector, embedding_model="counting", source_type="api",
            )
            stored = await session.scalar(select(MemoryEntry.embedding).where(MemoryEntry.id == entry_id))
            [same] = await repo.find_nearest(session, memory["id"], vector)
            [unrelated] = await repo.find_nearest(session, memory["id"], other)
    finally:
        event.remove(engine, "before_cursor_execute", capture)
    assert len(bound) == 1 and isinstance(bound[0], np.ndarray) and bound[0].dtype == np.float32
    assert list(stored) == pytest.approx(vector, abs=1e-7)  # float32, as pgvector keeps it
    assert same.entry_id == entry_id and same.score == pytest.approx(1.0, abs=1e-6)
    assert unrelated.score == pytest.approx(sum(a * b for a, b in zip(vector, other, strict=True)), abs=1e-5)


async def test_a_write_that_spoils_the_batch_fails_alone(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    class Spoiling(WriteApplier):
        async def _decide_locked(self, session: AsyncSession, event: MemoryWriteRequested, *args: Any, **kw: Any) -> Any:
            decided = await super()._decide_locked(session, event, *args, **kw)
            if event.content == "poison":
                raise RuntimeError("this write breaks its transaction")
            return decided

    applier = Spoiling(sessions, CountingEmbedder(), "counting")
    gone = (await client.post("/memories", json={"project_id": memory["project_id"], "name": "gone"})).json()
    await client.delete(f"/memories/{gone['id']}")
    batch = [write(memory, "Carol drives"), write(memory, "poison"), write(gone, "Too late"), write(memory, "Dan cooks")]
    results = await applier.apply_batch(batch)
    assert actions(results)[0] == "created" and actions(results)[3] == "created"
    assert isinstance(results[1], RuntimeError)
    # Not an exception: a decided failure, stored so that a retry with the same key can try again.
    assert isinstance(results[2], AppliedWrite) and results[2].outcome.error is not None
    assert results[2].outcome.error.status == 404
    # The rolled-back batch left nothing behind: each survivor exists once, the poison not at all.
    assert await valid_contents(sessions, memory["id"]) == ["Carol drives", "Dan cooks"]
    async with sessions() as session:
        assert await session.get(WriteOutcome, batch[1].write_id) is None
        failed = await session.get(WriteOutcome, batch[2].write_id)
    assert failed is not None and failed.status == "failed" and failed.error_code == "RESOURCE_NOT_FOUND"


async def test_an_embedding_failure_for_good_fails_only_the_writes_that_need_one(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    working = WriteApplier(sessions, CountingEmbedder(), "counting")
    assert actions(await working.apply_batch([write(memory, "Erin skis")])) == ["created"]

    async def down(_texts: Sequence[str]) -> list[list[float]]:
        raise EmbeddingError("counting", "provider down")

    results = await WriteApplier(sessions, down, "counting").apply_batch(
        [write(memory, "Erin skis"), write(memory, "Frank sails")]
    )
    assert isinstance(results[0], AppliedWrite) and results[0].outcome.action is WriteAction.SKIPPED
    assert isinstance(results[1], AppliedWrite) and results[1].outcome.error is not None
    assert results[1].outcome.error.code == "EMBEDDING_UNAVAILABLE"
    assert await valid_contents(sessions, memory["id"]) == ["Erin skis"]


class FlakyEmbedder(CountingEmbedder):
    """A remote provider that fails its first `failures` calls as one that may pass does (a rate limit, a timeout)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        if self.failures:
            self.failures -= 1
            self.calls.append(list(texts))
            raise EmbeddingError("flaky", "RateLimitError: slow down", transient=True)
        return await super().__call__(texts)


async def test_a_write_whose_embedding_may_pass_waits_for_it_and_is_decided(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # Stored as failed before, and acknowledged: a write answered 202 (a tool call told "it will be remembered", a
    # backlog drained while the provider rate-limited) was lost for good.
    embedder = FlakyEmbedder(failures=3)
    incoming = write(memory, "Hana runs marathons")
    async with own_partition(settings, sessions, WriteApplier(sessions, embedder, "flaky")) as partition:
        await partition.start()
        await partition.publish(incoming)
        await partition.until_decided(incoming)
        async with sessions() as session:
            stored = await session.get(WriteOutcome, incoming.write_id)
        assert stored is not None and (stored.status, stored.action) == ("applied", "created")
        assert stored.failed_attempts == 0
        # Refused as it was prepared and by two probes, waited out in place; the probe that answered, then the embedding.
        assert len(embedder.calls) == 5
        assert await partition.unacknowledged() == 0
    assert await valid_contents(sessions, memory["id"]) == ["Hana runs marathons"]


async def test_an_embedders_outage_is_waited_out_until_it_answers_a_probe(
    sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # Decided again after each pause, a set-aside merge asked its model again every time (its rewrite is checked by
    # its embedding, which failed): up to 120 paid calls an hour a lane while the embedder was down.
    embedder = FlakyEmbedder(failures=2)
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(WriteApplier(sessions, embedder, "flaky"), nc, settings, model_lanes=1)
        down = EmbeddingError("flaky", "RateLimitError: slow down", transient=True)
        await asyncio.wait_for(handler._wait_out(down, 0.01), 10)
        assert len(embedder.calls) == 3  # two probes refused, the third answered: only then is the batch decided
        database_down = OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
        await asyncio.wait_for(handler._wait_out(database_down, 0.01), 10)
        assert len(embedder.calls) == 3  # another outage asks the embedder nothing
    finally:
        await nc.close()


async def test_an_exact_copy_gone_before_the_lock_is_embedded_aside_not_in_the_shared_transaction(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # Embedded in the transaction every partition shares, it held all their memories' locks while the embedder took
    # its time (up to 30 s a call for a remote one).
    embedder = CountingEmbedder()
    applier = WriteApplier(sessions, embedder, "counting")
    (first,) = await applier.apply_batch([write(memory, "Ivo keeps bees")])
    assert isinstance(first, AppliedWrite) and first.outcome.entry_id
    (prepared,) = await applier.prepare([write(memory, "Ivo keeps bees")])
    assert prepared.embedding is None and len(embedder.calls) == 1  # an exact copy: nothing to embed
    assert (await client.delete(f"/memory-entries/{first.outcome.entry_id}")).status_code == 204
    (together,) = await applier.decide([prepared], defer_waits=True)
    assert isinstance(together, Deferred) and "exact copy has gone" in together.why
    assert len(embedder.calls) == 1
    (aside,) = await applier.decide([prepared])  # as a lane decides it
    assert isinstance(aside, AppliedWrite) and aside.outcome.action is WriteAction.CREATED
    assert len(embedder.calls) == 2


async def test_an_outage_met_by_a_batchs_transaction_is_not_met_again_by_each_write_alone(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    working = WriteApplier(sessions, CountingEmbedder(), "counting")
    stored = await working.apply_batch([write(memory, "Jo sings"), write(memory, "Kim paints")])
    prepared = await working.prepare([write(memory, "Jo sings"), write(memory, "Kim paints")])
    for one in stored:
        assert isinstance(one, AppliedWrite)
        assert (await client.delete(f"/memory-entries/{one.outcome.entry_id}")).status_code == 204
    # Both copies gone: each must be embedded under the lock, and the provider answers no one.
    flaky = FlakyEmbedder(failures=10)
    results = await WriteApplier(sessions, flaky, "counting").decide(prepared)
    assert all(isinstance(one, EmbeddingError) and one.transient for one in results), results
    assert len(flaky.calls) == 1  # before, each write was tried alone after it: three waits on a hung provider
    async with sessions() as session:
        assert await write_records.get_write_outcomes(session, [one.event.write_id for one in prepared]) == {}


async def test_the_tokens_of_a_merge_are_metered_though_its_transaction_then_fails(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    llm: ScriptedLLM, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Stored in the decision's transaction, the usage rolled back with it: the model had answered (and the metrics
    # counted its tokens), the project's /usage never showed them.
    llm.script("metered", MERGED)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL)
    (memory,) = await holding_email(client, project, applier, "metered")

    async def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("the insert failed")

    monkeypatch.setattr(WriteApplier, "_carry_out", broken)
    (result,) = await applier.apply_batch([write(memory, EMAIL_DETAIL, agent=AgentContext(model="scripted/metered"))])
    assert isinstance(result, RuntimeError)
    asked = len(llm.calls_to("metered"))
    async with sessions() as session:
        metered = (await session.scalars(select(LlmUsage).where(LlmUsage.project_id == project["id"]))).all()
    assert asked >= 1 and [(row.model, row.purpose) for row in metered] == [("scripted/metered", "merge")] * asked
    assert await valid_contents(sessions, memory["id"]) == [EMAIL]


def test_the_stored_records_name_every_column_the_writer_sets() -> None:
    """A column added to a table must be added to its record, or every write would store it empty."""
    set_by_server = {"id", "created_at", "updated_at"}
    set_by_the_claim = {"request_hash", "published_at"}  # the gateway's, kept by the writer's upsert (next test)
    for record, table in ((write_records.OutcomeRow, WriteOutcome.__table__), (write_records.HistoryRow, EntryHistory.__table__)):
        assert set(record.__slots__) == {c.key for c in table.columns} - set_by_server - set_by_the_claim


async def test_outcomes_and_audit_records_are_stored_as_given(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    project_id, memory_id = memory["project_id"], memory["id"]
    claimed, fresh = new_write_id(), new_write_id()
    async with sessions.begin() as session:
        # A pending claim to overwrite, whose client's request hash the writer's record must keep.
        await write_records.claim_write_id(session, claimed, project_id, memory_id, request_hash="h" * 64)
    outcomes = [
        write_records.OutcomeRow(claimed, project_id, memory_id, "applied", "skipped", "ent_a", 0.9731, failed_attempts=2),
        write_records.OutcomeRow(fresh, project_id, memory_id, "failed", error_code="E", error_message="superseded below"),
        write_records.OutcomeRow(fresh, project_id, memory_id, "failed", error_code="E", error_message='quote " and \\ ü'),
    ]
    history = [
        write_records.HistoryRow(project_id, memory_id, "ent_a", "skipped", claimed, rule="near", score=0.9731,
                           candidate_ids=["ent_a", "ent_b"], content_after="line\nbreak"),
        write_records.HistoryRow(project_id, memory_id, "ent_c", "edited", content_before="x", content_after=None),
        write_records.HistoryRow(project_id, memory_id, "ent_d", "created", score=float("nan")),  # JSON has no NaN
    ]
    async with sessions.begin() as session:
        await write_records.save_records(session, outcomes, history)
    async with sessions() as session:
        stored = {o.write_id: o for o in await session.scalars(select(WriteOutcome).where(WriteOutcome.memory_id == memory_id))}
        audit = list(await session.scalars(
            select(EntryHistory).where(EntryHistory.memory_id == memory_id).order_by(EntryHistory.id)
        ))
    expected = [outcomes[0], outcomes[2]]  # of a write id's records, the last is stored
    assert [write_records.OutcomeRow(**{k: getattr(stored[o.write_id], k) for k in o.__slots__}) for o in expected] == expected
    assert len(stored) == 2
    assert (stored[claimed].request_hash, stored[fresh].request_hash) == ("h" * 64, None)
    assert [write_records.HistoryRow(**{k: getattr(h, k) for k in history[0].__slots__}) for h in audit] == [
        *history[:2], replace(history[2], score=None)
    ]


@pytest.mark.parametrize(
    ("rule", "prompt_version"),
    [("merged", "merge-v2"), ("arbitration_failed:merged", "merge-v2"), ("arbitrated:update", "arbitrate-v2"),
     # Asked, though its answer was not used: the audit still names it.
     ("arbitration_failed:guard:order", "arbitrate-v2"), ("merge_failed", "merge-v2"),
     ("arbitration_unavailable:guard:order", None), ("near_duplicate", None)],
)
def test_the_audit_names_the_model_of_whichever_step_asked_it(rule: str, prompt_version: str | None) -> None:
    from shared.decision import Candidate, Decision
    from shared.events import AgentContext, WriteAction
    from shared.llm import ModelSteps
    from shared.writes import Written, _history

    event = write({"id": "mem_a", "project_id": "proj_a"}, "A fact")
    target = Candidate("mem_entry_a", "An old fact", 0.8)
    decision = Decision(WriteAction.UPDATED if "merged" in rule else WriteAction.CREATED, rule, target, "Merged")
    steps = ModelSteps(AgentContext(model="scripted/m"), timeout=1.0)
    record = _history(event, decision, Written("mem_entry_a", "Merged"), [target], steps)
    assert (record.model, record.prompt_version) == (("scripted/m" if prompt_version else None), prompt_version)


async def holding_email(
    client: httpx.AsyncClient, project: dict[str, Any], applier: WriteApplier, *names: str
) -> list[dict[str, Any]]:
    """New memories, each holding EMAIL: an agent's EMAIL_DETAIL to one asks its model for a merge."""
    memories = [await new_memory(client, project, name) for name in names]
    await applier.apply_batch([write(memory, EMAIL) for memory in memories])
    return memories


class RecordedMessage:
    """A delivered write message that records what the writer does with it, the subject of the tests that use it
    (everything else they run on is the real database and bus). Messages given one `settled` list record in order."""

    is_acked = False
    data = b"{}"

    def __init__(
        self, sequence: int = 1, *, delivered: int = 1, subject: str = "",
        settled: list[tuple[int, str, float | None]] | None = None,
    ) -> None:
        self.sequence, self.subject = sequence, subject
        self.metadata = SimpleNamespace(num_delivered=delivered, sequence=SimpleNamespace(stream=sequence))
        self.settled = [] if settled is None else settled

    async def nak(self, delay: float | None = None) -> None:
        self.settled.append((self.sequence, "nak", delay))

    async def ack(self) -> None:
        self.settled.append((self.sequence, "ack", None))


class HeldModel:
    """Every merge (or arbitration) a model is asked for waits until released, then fails; `asked` counts them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, step: str = "consolidate") -> None:
        self.asked: list[tuple[Any, ...]] = []
        self.release = asyncio.Event()

        async def held(_steps: Any, *question: Any) -> None:
            self.asked.append(question)
            await self.release.wait()

        monkeypatch.setattr(ModelSteps, step, held)

    async def until_asked(self, count: int) -> None:
        for _ in range(200):
            if len(self.asked) >= count:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"the model was asked {len(self.asked)} times, not {count}")


class OwnPartition:
    """A partition no running writer consumes, fed and decided here by one handler."""

    def __init__(
        self, settings: Settings, sessions: async_sessionmaker[AsyncSession], handler: WriteHandler,
        ack_wait_s: float = 30.0,
    ) -> None:
        self.number = settings.memories_partitions + 9
        self._sessions = sessions
        self.handler = handler
        self._js = handler._js
        self._ack_wait_s = ack_wait_s
        self._consumer = PartitionConsumer(
            handler._nc, self.number, handler.prepare, handler.finish, batch=32, ack_wait_s=ack_wait_s
        )

    async def start(self) -> None:
        await self._js.add_consumer(
            bus.WRITES_STREAM, bus.writer_consumer(self.number, max_ack_pending=64, ack_wait_s=self._ack_wait_s)
        )
        self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop(timeout=10)
        await self.handler.finish_lanes(timeout=0)  # what a failed test left in a lane is cancelled
        await self._consumer.release()
        await self._js.delete_consumer(bus.WRITES_STREAM, bus.writer_durable(self.number))
        # Nothing a failed test left undecided reaches the next one's partition.
        await self._js.purge_stream(bus.WRITES_STREAM, subject=bus.partition_filter(self.number))

    async def publish(self, *events: MemoryWriteRequested) -> None:
        for one in events:
            await self._js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{self.number}.{one.memory_id}", one.model_dump_json().encode())

    async def decided(self, *events: MemoryWriteRequested) -> bool:
        async with self._sessions() as session:
            stored = await write_records.get_write_outcomes(session, [one.write_id for one in events])
        return all(stored.get(one.write_id) is not None for one in events)

    async def until_decided(self, *events: MemoryWriteRequested) -> None:
        for _ in range(200):
            if await self.decided(*events):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("not decided within 10 s")

    async def unacknowledged(self) -> int:
        for _ in range(100):
            info = await self._js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(self.number))
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.05)
        return info.num_ack_pending + info.num_pending


@asynccontextmanager
async def own_partition(
    settings: Settings, sessions: async_sessionmaker[AsyncSession], applier: WriteApplier, *, model_lanes: int = 16,
    ack_wait_s: float = 30.0,
) -> AsyncIterator[OwnPartition]:
    nc = await nats.connect(settings.nats_url)
    partition = OwnPartition(settings, sessions, WriteHandler(applier, nc, settings, model_lanes=model_lanes), ack_wait_s)
    try:
        yield partition
    finally:
        await partition.stop()
        await nc.close()


async def test_a_write_waiting_on_a_model_holds_up_its_own_memorys_writes_only(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Memories share a partition with many others, of other projects too: an agent's merge by a slow model must
    # not hold their writes, in its batch or in the batches after it; its own memory's later writes wait for it.
    model = HeldModel(monkeypatch)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL)
    (merging,), neighbour = await holding_email(client, project, applier, "merging"), await new_memory(client, project, "n")
    merge = write(merging, EMAIL_DETAIL, agent=AgentContext(model="scripted/held"))
    later, neighbours = write(merging, "Customer's desk is by the window"), write(neighbour, "Bob rides a bike")
    next_neighbours = write(neighbour, "Bob commutes by train in winter")
    set_aside_before = metrics.REGISTRY.get_sample_value("memories_writes_set_aside")
    async with own_partition(settings, sessions, applier) as partition:
        await partition.publish(merge, neighbours)  # one batch
        await partition.start()
        await model.until_asked(1)
        await partition.until_decided(neighbours)
        await partition.publish(later, next_neighbours)  # the next batch
        await partition.until_decided(next_neighbours)
        assert not await partition.decided(merge) and not await partition.decided(later)  # in their lane, in order
        assert metrics.REGISTRY.get_sample_value("memories_writes_set_aside") == set_aside_before + 2
        model.release.set()
        await partition.until_decided(merge, later)
        assert await partition.unacknowledged() == 0
        assert metrics.REGISTRY.get_sample_value("memories_writes_set_aside") == set_aside_before
    assert await valid_contents(sessions, merging["id"]) == [EMAIL, EMAIL_DETAIL, "Customer's desk is by the window"]


async def test_a_memory_another_transaction_holds_is_waited_for_aside(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # Another writer replica deciding a memory (its model may take 30 s) or an API edit holds the memory's lock:
    # the transaction the partitions share must not wait for it, the memory's writes wait aside.
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    held, neighbour = await new_memory(client, project, "held"), await new_memory(client, project, "neighbour")
    waiting, later = write(held, "A fact for the held memory"), write(held, "A later fact for it")
    neighbours = write(neighbour, "A fact for its neighbour")
    async with own_partition(settings, sessions, applier) as partition:
        await partition.start()
        async with sessions() as holder, holder.begin():
            await repo.lock_memory(holder, held["id"])
            await partition.publish(waiting, neighbours)
            await partition.until_decided(neighbours)
            await wait_until_blocked_by(holder, "the held memory's write")  # waiting for the lock, not asking again
            await partition.publish(later)
            await asyncio.sleep(0.3)
            assert not await partition.decided(waiting) and not await partition.decided(later)
        await partition.until_decided(waiting, later)
        assert await partition.unacknowledged() == 0
    assert await valid_contents(sessions, held["id"]) == ["A fact for the held memory", "A later fact for it"]


async def test_a_write_citing_a_conversation_being_forgotten_is_waited_for_aside(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # Forgetting a conversation locks it exclusively, waiting for the writes that cite it (a lane's, behind a slow
    # model). The transaction every partition shares asked for its share lock and queued behind the forgetting,
    # and every partition of the writer waited with it: it must leave such a write to a lane instead.
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    cited, neighbour = await new_memory(client, project, "cited"), await new_memory(client, project, "neighbour")
    citing = write(cited, "A fact from the conversation", source_conversation_id="conv_being_forgotten")
    later, neighbours = write(cited, "A later fact of that memory"), write(neighbour, "A fact for its neighbour")
    prepared = await applier.prepare([citing, neighbours, later])
    async with sessions() as forgetting, forgetting.begin():
        await repo.clear_provenance(forgetting, project["id"], conversation_id="conv_being_forgotten")
        results = await asyncio.wait_for(applier.decide(prepared, defer_waits=True), 5)
    assert isinstance(results[0], Deferred) and isinstance(results[2], Deferred)
    assert actions(results[1:2]) == ["created"]
    # In its lane, it waits for the forgetting and is stored without the reference forgotten before it was decided.
    (applied,) = await applier.decide([prepared[0]])
    assert isinstance(applied, AppliedWrite) and applied.outcome.action == WriteAction.CREATED
    async with sessions() as session:
        entry = await session.get(MemoryEntry, applied.outcome.entry_id)
    assert entry is not None and entry.source_conversation_id is None


async def test_a_write_waiting_on_arbitration_is_set_aside_like_a_merge(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A REST write may ask for arbitration, which the service's own model makes.
    model = HeldModel(monkeypatch, "arbitrate")
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL, default_model="scripted/arbiter")
    arbitrated, other = await new_memory(client, project, "arbitrated"), await new_memory(client, project, "other")
    await applier.apply_batch([write(arbitrated, "Ada prefers tea")])
    slow = write(arbitrated, "Ada prefers green tea", write_policy=WritePolicy.ARBITRATE)
    quick = write(other, "Bob rides a bike")
    async with own_partition(settings, sessions, applier) as partition:
        await partition.publish(slow, quick)
        await partition.start()
        await model.until_asked(1)
        await partition.until_decided(quick)
        assert not await partition.decided(slow)
        model.release.set()
        await partition.until_decided(slow)


async def test_a_lane_commits_and_answers_each_write_before_it_asks_a_model_about_the_next(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A lane holds its memory's lock while a model answers. One transaction for all of a memory's set-aside writes
    # held the lock (and every edit of the memory) through all of their model calls, kept each answer from its
    # caller until the last was in, and lost the answers already given to an outage met at the last.
    asked: list[tuple[Any, ...]] = []
    release = asyncio.Event()

    async def second_held(_steps: Any, *question: Any) -> None:
        asked.append(question)
        if len(asked) > 1:
            await release.wait()

    monkeypatch.setattr(ModelSteps, "arbitrate", second_held)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL, default_model="scripted/arbiter")
    memory = await new_memory(client, project, "arbitrated")
    await applier.apply_batch([write(memory, "Ada prefers tea")])
    first = write(memory, "Ada prefers green tea", write_policy=WritePolicy.ARBITRATE)
    second = write(memory, "Ada prefers her tea without sugar", write_policy=WritePolicy.ARBITRATE)
    async with own_partition(settings, sessions, applier) as partition:
        await partition.publish(first, second)  # one batch, one lane
        await partition.start()
        for _ in range(200):
            if len(asked) >= 2:
                break
            await asyncio.sleep(0.05)
        assert len(asked) == 2
        assert await partition.decided(first) and not await partition.decided(second)
        release.set()
        await partition.until_decided(second)
    assert await valid_contents(sessions, memory["id"]) == [
        "Ada prefers tea", "Ada prefers green tea", "Ada prefers her tea without sugar"
    ]


async def test_a_batch_that_could_not_be_prepared_is_prepared_again_before_its_writes_are_set_aside(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Which writes may wait on a model is known only once they are prepared: a batch that met an outage there is
    # prepared again in place, then its merge set aside (not decided in the partition's stead, holding it up).
    model = HeldModel(monkeypatch)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL)
    prepare, preparing = applier.prepare, []

    async def down_at_first(events: Sequence[MemoryWriteRequested]) -> list[PreparedWrite]:
        preparing.append(len(events))
        if len(preparing) == 1:
            raise OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
        return await prepare(events)

    (merging,), neighbour = await holding_email(client, project, applier, "merging"), await new_memory(client, project, "n")
    monkeypatch.setattr(applier, "prepare", down_at_first)
    merge, neighbours = write(merging, EMAIL_DETAIL, agent=AgentContext(model="scripted/held")), write(neighbour, "Bob")
    async with own_partition(settings.model_copy(update={"memories_retry_backoff_s": 0.1}), sessions, applier) as partition:
        await partition.publish(merge, neighbours)
        await partition.start()
        await model.until_asked(1)
        await partition.until_decided(neighbours)
        assert preparing == [2, 2]  # once more after the outage, and not again in the lane
        model.release.set()
        await partition.until_decided(merge)


async def test_a_memory_held_once_the_shared_transaction_is_spoilt_is_left_to_wait_with_its_later_writes(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # The writes of a spoilt transaction are applied one by one; a memory another transaction takes meanwhile is
    # not waited for, and its later writes are not decided before the one left to wait, even once it is free.
    busy, other = await new_memory(client, project, "busy"), await new_memory(client, project, "other")
    first, then = write(busy, "First fact of the busy memory"), write(busy, "Second fact of the busy memory")
    async with sessions() as holder:

        class SpoiltThenHeld(WriteApplier):
            async def _decide_locked(self, session: AsyncSession, event: MemoryWriteRequested, *args: Any, **kw: Any) -> Any:
                if event.content == "poison":
                    raise RuntimeError("this write breaks its transaction")
                return await super()._decide_locked(session, event, *args, **kw)

            async def _apply_alone(self, prepared: PreparedWrite, *, defer_waits: bool) -> Any:
                if prepared.event.write_id == first.write_id:  # taken just before, let go just after
                    async with holder.begin():
                        await repo.lock_memory(holder, busy["id"])
                        return await super()._apply_alone(prepared, defer_waits=defer_waits)
                return await super()._apply_alone(prepared, defer_waits=defer_waits)

        applier = SpoiltThenHeld(sessions, CountingEmbedder(), "counting")
        batch = [write(other, "Carol drives"), write(other, "poison"), first, then]
        results = await asyncio.wait_for(applier.decide(await applier.prepare(batch), defer_waits=True), 10)
    assert actions(results[:1]) == ["created"] and isinstance(results[1], RuntimeError)
    assert isinstance(results[2], Deferred) and isinstance(results[3], Deferred)
    assert await valid_contents(sessions, busy["id"]) == []


async def test_a_write_routed_by_a_policy_changed_since_asks_no_model_in_the_shared_transaction(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The writer routes a write by its memory's policy as it last saw it: a memory made arbitrated since would have
    # its write arbitrated inside the transaction every partition shares, every partition waiting for the model.
    model = HeldModel(monkeypatch, "arbitrate")
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL, default_model="scripted/arbiter")
    changed, other = await new_memory(client, project, "changed"), await new_memory(client, project, "other")
    await applier.apply_batch([write(changed, "Ada prefers tea"), write(other, "Bob walks")])  # remembered: seed
    await client.put(f"/memories/{changed['id']}", json={"write_policy": "arbitrate"})
    arbitrated, later = write(changed, "Ada prefers green tea"), write(changed, "Ada's desk is by the window")
    quick = write(other, "Bob rides a bike")
    prepared = await applier.prepare([arbitrated, quick, later])
    assert not any(applier.may_wait_on_a_model(one) for one in prepared)  # as the writer saw it
    results = await asyncio.wait_for(applier.decide(prepared, defer_waits=True), 10)
    assert isinstance(results[0], Deferred) and isinstance(results[2], Deferred) and actions(results[1:2]) == ["created"]
    assert model.asked == []
    async with own_partition(settings, sessions, applier) as partition:  # as the writer does then: aside, asking
        await partition.publish(arbitrated, later)
        await partition.start()
        await model.until_asked(1)
        model.release.set()
        await partition.until_decided(arbitrated, later)
    assert await valid_contents(sessions, changed["id"]) == ["Ada prefers tea", "Ada prefers green tea",
                                                             "Ada's desk is by the window"]


async def test_memories_waiting_on_models_are_bounded_and_a_later_write_waits_behind_one_waiting_for_its_turn(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each lane holds a database connection while its model answers: no more than the writer's pool has room for.
    # The second memory's merge waits for its turn, holding no lock yet: its memory's next write, one that needs no
    # model, must still wait behind it rather than be decided at once.
    model = HeldModel(monkeypatch)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL)
    first, second = await holding_email(client, project, applier, "first", "second")
    agent = AgentContext(model="scripted/held")
    merges = [write(first, EMAIL_DETAIL, agent=agent), write(second, EMAIL_DETAIL, agent=agent)]
    later = write(second, "Customer's desk is by the window")
    async with own_partition(settings, sessions, applier, model_lanes=1) as partition:
        await partition.publish(*merges)
        await partition.start()
        await model.until_asked(1)
        await partition.publish(later)
        await asyncio.sleep(1.0)  # time enough for the second merge to be asked, and the later write decided, if let
        assert len(model.asked) == 1 and not await partition.decided(later)
        model.release.set()
        await partition.until_decided(*merges, later)
        assert len(model.asked) == 2
    assert await valid_contents(sessions, second["id"]) == [EMAIL, EMAIL_DETAIL, "Customer's desk is by the window"]


async def test_a_stop_cancels_the_set_aside_writes_it_cannot_wait_for_and_hands_them_back_in_order(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    # A model call may take 30 s, longer than a stop's budget: the lanes are cancelled, their transactions rolled
    # back, and their writes handed back at once, in order. Left to the ack wait (30 s here), they would come back
    # after writes published meanwhile, and the next writer would decide those first.
    model = HeldModel(monkeypatch)
    applier = WriteApplier(sessions, local_embed, LOCAL_MODEL)
    (memory,) = await holding_email(client, project, applier, "merging")
    merge = write(memory, EMAIL_DETAIL, agent=AgentContext(model="scripted/held"))
    later = write(memory, "Customer's desk is by the window")
    set_aside_before = metrics.REGISTRY.get_sample_value("memories_writes_set_aside")
    async with own_partition(settings, sessions, applier) as partition:
        await partition.publish(merge)
        await partition.start()
        await model.until_asked(1)
        await partition.publish(later)  # in a second lane, behind the first
        for _ in range(100):
            if metrics.REGISTRY.get_sample_value("memories_writes_set_aside") == set_aside_before + 2:
                break
            await asyncio.sleep(0.05)
        with caplog.at_level(logging.INFO, logger="memories.writer"):
            await partition.handler.finish_lanes(timeout=0.2)
        assert "stopping: 2 set-aside writes handed back undecided" in caplog.text  # said, for the operator
        assert metrics.REGISTRY.get_sample_value("memories_writes_set_aside") == set_aside_before
        assert not await partition.decided(merge) and not await partition.decided(later)
        model.release.set()
        await partition.until_decided(merge, later)  # within 10 s: handed back, not left to the ack wait
        assert len(model.asked) == 2  # asked again on its redelivery
    assert await valid_contents(sessions, memory["id"]) == [EMAIL, EMAIL_DETAIL, "Customer's desk is by the window"]


async def test_which_writes_may_wait_on_a_model(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    seed, arbitrated = await new_memory(client, project, "seed"), await new_memory(client, project, "arbitrate")
    await client.put(f"/memories/{arbitrated['id']}", json={"write_policy": "arbitrate"})
    with_model = WriteApplier(sessions, CountingEmbedder(), "counting", default_model="scripted/arbiter")
    without_model = WriteApplier(sessions, CountingEmbedder(), "counting")
    await with_model.apply_batch([write(seed, "Stored first"), write(arbitrated, "Stored too")])

    async def may_wait(applier: WriteApplier, event: MemoryWriteRequested) -> bool:
        (prepared,) = await applier.prepare([event])
        return applier.may_wait_on_a_model(prepared)

    agent_write = write(seed, "An agent's fact", agent=AgentContext(model="scripted/agent"))
    assert await may_wait(without_model, agent_write)  # a merge
    assert not await may_wait(without_model, write(seed, "Stored first", agent=AgentContext(model="scripted/agent")))
    assert not await may_wait(without_model, write(seed, "x", write_policy=WritePolicy.ARBITRATE))
    assert await may_wait(with_model, write(arbitrated, "A new fact"))  # its memory's policy, as last decided
    assert not await may_wait(with_model, write(seed, "A new fact"))
    assert not await may_wait(with_model, write(arbitrated, "Stored too"))  # an exact copy asks no model
    assert await may_wait(with_model, write(seed, "Another", write_policy=WritePolicy.ARBITRATE))
    unseen = await new_memory(client, project, "not decided here yet")
    assert await may_wait(with_model, write(unseen, "A first fact"))  # its policy is not known yet


async def test_an_outage_met_by_one_write_stops_the_later_ones_and_what_was_decided_stands(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    memory = await new_memory(client, project, "outage")
    writes = [write(memory, "First fact said"), write(memory, "Second fact said later")]
    outcomes = iter(["down", "down", "up", "down", "up"])  # shared, first alone, second alone, ... then back
    decide_batch = WriteApplier._decide_batch

    async def flaky(self: WriteApplier, session: Any, batch: Any, **options: Any) -> Any:
        if next(outcomes, "up") == "down":
            raise OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
        return await decide_batch(self, session, batch, **options)

    monkeypatch.setattr(WriteApplier, "_decide_batch", flaky)
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    # The first write meets the outage alone: the second is not tried, so it cannot be decided before the first.
    results = await applier.decide(await applier.prepare(writes))
    assert all(isinstance(r, OperationalError) for r in results) and await valid_contents(sessions, memory["id"]) == []

    outcomes = iter(["down", "up", "down"])  # shared fails; the first alone commits; the second alone meets it
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(applier, nc, settings, model_lanes=1)
        prepared = await applier.prepare(writes)
        results = await handler._decide_through_outages(PreparedBatch([(None, w) for w in writes], prepared))  # type: ignore[misc]
    finally:
        await nc.close()
    # Each decided once, in order: the first is not decided again (it would come back replayed, unannounced).
    assert actions(results) == ["created", "created"]
    assert not any(r.replayed for r in results if isinstance(r, AppliedWrite))
    assert await valid_contents(sessions, memory["id"]) == ["First fact said", "Second fact said later"]


async def test_stopping_the_writer_ends_the_wait_for_an_outage_at_once(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    settings: Settings, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The batch is then handed back (redelivered), within the stop's budget, not after the pause it was in.
    async def down(self: WriteApplier, session: Any, batch: Any, **_options: Any) -> Any:
        raise OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))

    monkeypatch.setattr(WriteApplier, "_decide_batch", down)
    memory = await new_memory(client, project, "stopping")
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(applier, nc, settings.model_copy(update={"memories_retry_backoff_s": 60.0}), model_lanes=1)
        writes = [write(memory, "Waiting for the database")]
        waiting = asyncio.create_task(
            handler._decide_through_outages(PreparedBatch([(None, w) for w in writes], await applier.prepare(writes)))  # type: ignore[misc]
        )
        await asyncio.sleep(0.2)  # in its first pause, of 60 s
        handler.stop()
        results = await asyncio.wait_for(waiting, 10)
    finally:
        await nc.close()
    assert isinstance(results[0], OperationalError)


async def test_a_stopping_writer_hands_writes_back_at_once_not_each_after_its_own_delay(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # Stopped by an outage as the writer stops, two writes of one memory delivered a different number of times
    # would come back after different delays, the later one first.
    memory = await new_memory(client, project, "stopping")
    outage = OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(WriteApplier(sessions, CountingEmbedder(), "counting"), nc, settings, model_lanes=1)
        running, stopping = RecordedMessage(delivered=3), RecordedMessage(delivered=3)
        await handler._retry_or_give_up(running, write(memory, "First"), outage)  # type: ignore[arg-type]
        handler.stop()
        await handler._retry_or_give_up(stopping, write(memory, "First"), outage)  # type: ignore[arg-type]
    finally:
        await nc.close()
    assert running.settled == [(1, "nak", bus.retry_delay(settings.memories_retry_backoff_s, 3))]
    assert stopping.settled == [(1, "nak", None)]


async def test_a_write_handed_back_as_the_writer_stops_takes_its_memorys_later_writes_back_untried(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A lane decides its writes one at a time. The writer stopping no longer waits an outage out: the write it
    # stopped goes back, and the memory's later writes, in that lane or in one queued behind it, must go back after
    # it untried: the database back by then, they would be decided before it.
    settled: list[tuple[int, str, float | None]] = []
    tried: list[int] = []
    decide_batch = WriteApplier._decide_batch

    async def down_then_back(self: WriteApplier, session: Any, batch: Any, **options: Any) -> Any:
        tried.append(len(batch))
        if len(tried) <= 2:  # the first write's transaction (an outage: the write is not tried again alone)
            raise OperationalError("SELECT 1", {}, ConnectionError("server closed the connection"))
        return await decide_batch(self, session, batch, **options)

    memory = await new_memory(client, project, "stopping")
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    writes = [write(memory, f"Set-aside fact number {n}") for n in (1, 2, 3)]
    prepared = await applier.prepare(writes)
    monkeypatch.setattr(WriteApplier, "_decide_batch", down_then_back)
    messages = [RecordedMessage(n, settled=settled) for n in (1, 2, 3)]
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(applier, nc, settings, model_lanes=1)
        handler.stop()
        first = PreparedBatch(list(zip(messages[:2], writes[:2], strict=True)), prepared[:2])  # type: ignore[arg-type]
        await asyncio.wait_for(handler._decide_in_lane(None, first, messages[:2]), 10)  # type: ignore[arg-type]
        behind = PreparedBatch([(messages[2], writes[2])], prepared[2:])  # type: ignore[list-item]
        await asyncio.wait_for(handler._decide_in_lane(None, behind, messages[2:]), 10)  # type: ignore[arg-type]
    finally:
        await nc.close()
    assert tried == [1]  # never the second nor the third, though the database was back for them
    assert settled == [(1, "nak", None), (2, "nak", None), (3, "nak", None)]  # at once, in order
    assert await valid_contents(sessions, memory["id"]) == []


async def test_the_bus_failing_one_writes_settling_leaves_the_rest_of_its_batch_settled(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An ack, an answer or a dead letter the bus does not take (a timeout) for the first write of a batch: the
    # others were committed and were left unacknowledged and unanswered until the ack wait, behind later writes.
    memory = await new_memory(client, project, "settling")
    writes = [write(memory, f"Fact number {i}") for i in range(3)]
    settle = WriteHandler._settle

    async def first_fails(self: WriteHandler, message: Any, event: MemoryWriteRequested, applied: Any) -> None:
        if event.write_id == writes[0].write_id:
            raise nats.errors.TimeoutError
        await settle(self, message, event, applied)

    monkeypatch.setattr(WriteHandler, "_settle", first_fails)
    async with own_partition(settings, sessions, WriteApplier(sessions, CountingEmbedder(), "counting")) as partition:
        await partition.start()
        await partition.publish(*writes)
        await partition.until_decided(*writes)
        assert await partition.unacknowledged() == 1  # the first, back after the ack wait, then answered from its record
        # Each is announced on the change feed, the first too: delivered again, it is a replay, which announces nothing.
        feed = await partition._js.pull_subscribe(bus.event_subject(project["id"], "created"), stream=bus.EVENTS_STREAM)
        announced = {json.loads(m.data)["write_id"] for m in await feed.fetch(100, timeout=2)}
        assert {one.write_id for one in writes} <= announced


@pytest.mark.parametrize(
    ("failure", "settled", "dead_lettered"),
    [
        # Acknowledged first, a write whose failure could not be recorded (the database down) stayed pending for ever.
        (OperationalError("UPDATE", {}, ConnectionError("server closed the connection")), ["nak"], False),
        # What failed the write fails its record too (a value the table cannot hold): retried for ever, it was never
        # dead-lettered.
        (DataError("UPDATE", {}, ValueError("value too long for type character varying(32)")), ["ack"], True),
    ],
    ids=["outage", "lasting"],
)
async def test_a_write_given_up_on_is_acknowledged_only_once_its_failure_is_recorded(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings,
    monkeypatch: pytest.MonkeyPatch, failure: Exception, settled: list[str], dead_lettered: bool,
) -> None:
    async def record_fails(*_args: Any) -> AppliedWrite:
        raise failure

    memory = await new_memory(client, project, "given up")
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    monkeypatch.setattr(applier, "record_failure", record_fails)
    nc = await nats.connect(settings.nats_url)
    try:
        handler = WriteHandler(applier, nc, settings, model_lanes=1)
        message = RecordedMessage(delivered=settings.memories_max_deliver, subject=f"{bus.WRITE_SUBJECT_ROOT}.0.{memory['id']}")
        await handler._retry_or_give_up(message, write(memory, "Never applied"), RuntimeError("a bug"))  # type: ignore[arg-type]
        letters = await nc.jetstream().pull_subscribe(bus.dead_letter_subject("writer"), stream=bus.DEAD_LETTER_STREAM)
        parked: list[str] = []
        with contextlib.suppress(nats.errors.TimeoutError):  # none at all
            parked = [json.loads(m.data)["origin_subject"] for m in await letters.fetch(10_000, timeout=2)]
    finally:
        await nc.close()
    assert [action for _, action, _ in message.settled] == settled and (message.subject in parked) is dead_lettered


async def test_a_write_on_a_subject_naming_another_memory_is_answered_failed(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # Dead-lettered, it was never answered: its caller waited out the write timeout.
    memory, other = await new_memory(client, project, "named"), await new_memory(client, project, "other")
    async with own_partition(settings, sessions, WriteApplier(sessions, CountingEmbedder(), "counting")) as partition:
        answers = await partition.handler._nc.subscribe("_INBOX.mismatch")
        event = write(memory, "Filed under the wrong memory", reply_subject="_INBOX.mismatch")
        await partition.start()
        await partition._js.publish(
            f"{bus.WRITE_SUBJECT_ROOT}.{partition.number}.{other['id']}", event.model_dump_json().encode()
        )
        answer = MemoryWriteOutcome.model_validate_json((await answers.next_msg(timeout=10)).data)
        assert answer.write_id == event.write_id and answer.error is not None
        assert answer.error.code == "INTERNAL_ERROR"
        assert await partition.unacknowledged() == 0


async def test_the_policies_remembered_are_bounded_the_least_recently_written_forgotten_first(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(writes_module, "_POLICIES_REMEMBERED", 2)
    applier = WriteApplier(sessions, CountingEmbedder(), "counting", default_model="scripted/arbiter")
    first, second, third = [await new_memory(client, project, name) for name in ("first", "second", "third")]
    for memory in (first, second, first, third):  # `first` written again: `second` is now the oldest
        await applier.apply_batch([write(memory, f"A fact {new_write_id()}")])

    async def remembered_as_seed(memory: dict[str, Any]) -> bool:
        (prepared,) = await applier.prepare([write(memory, f"Another fact {new_write_id()}")])
        return not applier.may_wait_on_a_model(prepared)

    assert [await remembered_as_seed(m) for m in (first, second, third)] == [True, False, True]


async def test_a_memorys_entries_are_listed_in_the_order_their_writes_committed(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # A batch locks its memories in one order; while it waits for the first, another write to the second commits.
    waited_for, written_meanwhile = sorted([await new_memory(client, project, "a"), await new_memory(client, project, "b")],
                                           key=lambda memory: memory["id"])
    applier = WriteApplier(sessions, CountingEmbedder(), "counting")
    prepared = await applier.prepare([write(waited_for, "Ada prefers tea"), write(written_meanwhile, "Bob was batched")])
    async with sessions() as holder, holder.begin():
        await repo.lock_memories(holder, [waited_for["id"]])
        batch = asyncio.create_task(applier.decide(prepared))
        await wait_until_blocked_by(holder, "the batch")
        assert actions(await applier.apply_batch([write(written_meanwhile, "Bob wrote meanwhile")])) == ["created"]
    assert actions(await batch) == ["created", "created"]
    # Listed as committed: a client paging through the memory sees the later commit after the earlier one.
    listed = await client.get("/memory-entries", params={"memory_id": written_meanwhile["id"]})
    assert [entry["content"] for entry in listed.json()["data"]] == ["Bob wrote meanwhile", "Bob was batched"]
