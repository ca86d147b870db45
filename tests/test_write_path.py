"""The write path's guarantees with the real bus: idempotency, redelivery, the 202 path, ordering under
contention across two writer replicas, failures that write nothing, and dead letters."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import nats
import pytest
from nats.aio.msg import Msg
from pydantic import ValidationError
from sqlalchemy import func, select, update
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import bus, metrics, write_records
from shared import repository as repo
from shared.db.models import EntryHistory, MemoryEntry, WriteOutcome
from shared.db.session import create_engine, session_factory
from shared.embeddings import EmbeddingError
from shared.events import DEFAULT_DUPLICATE_THRESHOLD, MemoryWriteRequested, utcnow
from shared.ids import new_write_id
from shared.servers import LOOPBACK, EmbeddedNats, free_port
from shared.settings import WRITE_TIMEOUT_MAX_S, Settings
from shared.write_gateway import WriteGateway, request_hash
from shared.writes import REFUSED_FOR_NOW, WriteApplier
from tests.conftest import WriterWithoutEmbedder, open_api, open_client, wait_until_blocked_by


async def count_entries(sessions: async_sessionmaker[AsyncSession], memory_id: str) -> int:
    async with sessions() as session:
        return int(await session.scalar(select(func.count()).where(MemoryEntry.memory_id == memory_id)) or 0)


async def test_idempotency_key_returns_the_first_outcome(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    headers = {"Idempotency-Key": "order-42-fact-1"}
    body = {"memory_id": memory["id"], "content": "Order 42 ships by express", "metadata": {"a": 1, "b": 2}}
    first = await client.post("/memory-entries", json=body, headers=headers)
    assert first.status_code == 201
    again = await client.post("/memory-entries", json=body, headers=headers)
    assert again.status_code == 201 and again.json() == first.json()
    # The repeat says it is one: its "created" is the first call's, this one wrote nothing.
    assert (first.headers.get("idempotent-replayed"), again.headers.get("idempotent-replayed")) == (None, "true")
    reordered = await client.post("/memory-entries", json={**body, "metadata": {"b": 2, "a": 1}}, headers=headers)
    assert reordered.status_code == 201 and reordered.json() == first.json()
    # A key names one request: reused for another body or another memory, it is refused, not answered with
    # the first request's entry.
    other_memory = (await client.post("/memories", json={"project_id": memory["project_id"], "name": "B"})).json()
    for changed in ({**body, "content": "Other text"}, {**body, "tags": ["x"]}, {**body, "memory_id": other_memory["id"]}):
        refused = await client.post("/memory-entries", json=changed, headers=headers)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["meta"]["write_id"] == first.json()["write_id"]
    assert await count_entries(sessions, memory["id"]) == 1
    assert await count_entries(sessions, other_memory["id"]) == 0
    bad_key = await client.post("/memory-entries", json=body, headers={"Idempotency-Key": "has space"})
    assert bad_key.status_code == 400
    assert bad_key.json()["error"]["meta"]["invalid_fields"][0]["field"] == "Idempotency-Key"  # named, like any field
    # Two keys: the first was used, silently. Which one the client meant cannot be told.
    twice = await client.post("/memory-entries", json=body, headers=[("Idempotency-Key", "k1"), ("Idempotency-Key", "k2")])
    assert twice.status_code == 400 and "more than once" in twice.json()["error"]["message"]
    # Its entry deleted since, a retry is told so, and what to do to write the fact again.
    assert (await client.delete(f"/memory-entries/{first.json()['id']}")).status_code == 204
    gone = await client.post("/memory-entries", json=body, headers=headers)
    assert gone.status_code == 409 and "send it with a new Idempotency-Key" in gone.json()["error"]["message"]


def test_the_request_hash_is_of_what_the_client_chose() -> None:
    base = MemoryWriteRequested(event_id="wr_a", project_id="proj_a", memory_id="mem_a", content="A fact",
                                metadata={"a": 1, "b": 2})
    retry = base.model_copy(update={"event_id": "wr_b", "reply_subject": "inbox.1", "occurred_at": utcnow(),
                                    "metadata": {"b": 2, "a": 1}, "duplicate_threshold": DEFAULT_DUPLICATE_THRESHOLD})
    assert request_hash(retry) == request_hash(base)  # delivery details, key order and spelt-out defaults aside
    for change in ({"content": "Another fact"}, {"memory_id": "mem_b"}, {"duplicate_threshold": 0.9}, {"tags": []}):
        assert request_hash(base.model_copy(update=change)) != request_hash(base), change


async def test_a_repeated_key_whose_entry_was_deleted_answers_409(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    """A repeat is answered from the stored outcome, whose entry is read back: here it has gone."""
    headers = {"Idempotency-Key": "order-43-fact-1"}
    body = {"memory_id": memory["id"], "content": "Order 43 ships by sea"}
    first = await client.post("/memory-entries", json=body, headers=headers)
    assert first.status_code == 201
    assert (await client.delete(f"/memory-entries/{first.json()['id']}")).status_code == 204
    again = await client.post("/memory-entries", json=body, headers=headers)
    assert again.status_code == 409
    assert again.json()["error"]["meta"]["write_id"] == first.json()["write_id"]


async def test_timeout_answers_202_and_the_outcome_is_readable_later(
    settings: Settings, writers: list[Any], memory: dict[str, Any]
) -> None:
    impatient = settings.model_copy(update={"memories_write_timeout_s": 0.001})
    async for client in open_client(impatient):
        accepted = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Slow fact"})
        assert accepted.status_code == 202
        write_id = accepted.json()["write_id"]
        assert accepted.json()["status"] == "pending"
        status: dict[str, Any] = {}
        for _ in range(200):
            status = (await client.get(f"/memory-writes/{write_id}")).json()
            if status["status"] != "pending":
                break
            await asyncio.sleep(0.05)
        assert status["status"] == "applied" and status["action"] == "created"
        entry = (await client.get(f"/memory-entries/{status['entry_id']}")).json()
        assert entry["content"] == "Slow fact"
        assert (await client.get("/memory-writes/wr_" + "0" * 32)).status_code == 404
        assert (await client.get("/memory-writes/garbage")).status_code == 404


async def test_a_write_queued_while_the_database_is_down_answers_202_not_an_error(
    settings: Settings, writers: list[Any], memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # The API's own database is unreachable after it published (the writer's still works, so it applies it).
    unreachable = create_engine(f"postgresql+psycopg://postgres@{LOOPBACK}:{free_port()}/memories")
    nc = await nats.connect(settings.nats_url)
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Queued in an outage"
    )
    try:
        gateway = WriteGateway(nc, session_factory(unreachable), settings.memories_partitions)
        await gateway.start()
        # Not decided in time, and the pending record cannot be stored: still a 202 with its write id, since
        # the write is queued and will be applied (a 503 would tell the caller it failed).
        assert await gateway.submit(event, timeout=0.001, fresh_id=True) is None
    finally:
        await nc.close()
        await unreachable.dispose()
    assert (await _wait_applied(sessions, event.write_id)).action == "created"


async def test_a_write_that_failed_while_its_caller_gave_up_waiting_stays_failed(
    settings: Settings, writers: list[Any], client: httpx.AsyncClient, memory: dict[str, Any],
    sessions: async_sessionmaker[AsyncSession], monkeypatch: Any,
) -> None:
    # The writer records the failure (the memory is gone) just before the API records its 202 as pending.
    gone = (await client.post("/memories", json={"project_id": memory["project_id"], "name": "gone"})).json()
    assert (await client.delete(f"/memories/{gone['id']}")).status_code == 204
    event = MemoryWriteRequested(event_id=new_write_id(), project_id=gone["project_id"], memory_id=gone["id"], content="Late")
    nc = await nats.connect(settings.nats_url)
    try:
        gateway = WriteGateway(nc, sessions, settings.memories_partitions)
        await gateway.start()
        decide_in_time = gateway._publish_and_wait

        async def answered_too_late(*args: Any, **kwargs: Any) -> None:
            await decide_in_time(*args, **kwargs)  # the failure is stored by now

        monkeypatch.setattr(gateway, "_publish_and_wait", answered_too_late)
        assert await gateway.submit(event, timeout=15, fresh_id=True) is None
    finally:
        await nc.close()
    status = (await client.get(f"/memory-writes/{event.write_id}")).json()
    assert status["status"] == "failed" and status["error"]["code"] == "RESOURCE_NOT_FOUND"


async def _publish_raw(settings: Settings, event: MemoryWriteRequested, msg_id: str) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        await nc.jetstream().publish(
            bus.write_subject(event.memory_id, settings.memories_partitions),
            event.model_dump_json().encode(),
            stream=bus.WRITES_STREAM,
            headers={"Nats-Msg-Id": msg_id},
        )
    finally:
        await nc.close()


async def _wait_applied(sessions: async_sessionmaker[AsyncSession], write_id: str) -> WriteOutcome:
    for _ in range(200):
        async with sessions() as session:
            outcome = await session.get(WriteOutcome, write_id)
        if outcome is not None and outcome.status == "applied":
            return outcome
        await asyncio.sleep(0.05)
    raise AssertionError(f"write {write_id} was never applied")


async def test_a_redelivered_write_has_one_effect(
    settings: Settings, writers: list[Any], memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Delivered twice"
    )
    # Two different message ids defeat the stream's duplicate window: only the outcome table guards now.
    await _publish_raw(settings, event, f"{event.write_id}.a")
    await _publish_raw(settings, event, f"{event.write_id}.b")
    await _wait_applied(sessions, event.write_id)
    await asyncio.sleep(0.5)
    assert await count_entries(sessions, memory["id"]) == 1
    async with sessions() as session:
        history = await session.scalar(select(func.count()).where(EntryHistory.write_id == event.write_id))
    assert history == 1


async def test_concurrent_identical_writes_make_one_entry(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    body = {"memory_id": memory["id"], "content": "The customer's account number is 991"}
    responses = await asyncio.gather(*(client.post("/memory-entries", json=body) for _ in range(50)))
    actions = sorted(r.json()["action"] for r in responses)
    assert actions == ["created"] + ["skipped"] * 49
    assert len({r.json()["id"] for r in responses}) == 1
    assert await count_entries(sessions, memory["id"]) == 1


async def test_writes_to_many_memories_proceed_and_all_apply(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    memories = [
        (await client.post("/memories", json={"project_id": project["id"], "name": f"m{i}"})).json()
        for i in range(8)
    ]
    topics = ["ships orders on Tuesdays", "pays invoices by wire transfer", "speaks Portuguese at meetings"]
    writes = [
        client.post("/memory-entries", json={"memory_id": m["id"], "content": f"The customer {topic}"})
        for m in memories
        for topic in topics
    ]
    responses = await asyncio.gather(*writes)
    assert all(r.status_code == 201 for r in responses), [r.text for r in responses if r.status_code != 201]


async def test_a_failing_embedder_fails_the_write_and_writes_nothing(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    async def broken(_texts: Any) -> list[list[float]]:
        raise EmbeddingError("broken-model", "provider down")

    applier = WriteApplier(sessions, broken, "broken-model")
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Unembeddable"
    )
    applied = await applier.apply(event)
    assert applied.outcome.error is not None
    assert applied.outcome.error.status == 503 and applied.outcome.error.code == "EMBEDDING_UNAVAILABLE"
    assert await count_entries(sessions, memory["id"]) == 0
    async with sessions() as session:
        stored = await session.get(WriteOutcome, event.write_id)
    assert stored is not None and stored.status == "failed" and stored.failed_attempts == 1


async def test_a_write_the_bus_did_not_take_is_a_503_naming_its_write_id(
    settings: Settings, memory: dict[str, Any], tmp_path: Path
) -> None:
    """On a NATS server of its own. A publish a hung server never confirmed may reach the stream later and be applied
    (seen in a walk-through: the entry appeared after the 503, which said only "unavailable" with no write id). One
    refused before it was sent (the client knows it is disconnected) was not sent at all, and says so."""
    with EmbeddedNats(tmp_path / "nats") as own:
        async with open_api(settings.model_copy(update={"nats_url": own.url})) as (app, api):
            assert own.pid is not None
            os.kill(own.pid, signal.SIGSTOP)  # hung: the connection stays up, nothing answers
            try:
                hung = await api.post("/memory-entries", json={"memory_id": memory["id"], "content": "Into a hung bus"})
            finally:
                os.kill(own.pid, signal.SIGCONT)
            assert hung.status_code == 503, hung.text
            error = hung.json()["error"]
            assert error["code"] == "SERVICE_UNAVAILABLE" and "may still be applied" in error["message"]
            assert error["meta"]["write_id"].startswith("wr_")
            # It reached the stream once the server went on: a writer would apply it.
            async with asyncio.timeout(10):  # once the server has read what was waiting on its socket
                while (await app.state.nats.jetstream().stream_info(bus.WRITES_STREAM)).state.messages != 1:
                    await asyncio.sleep(0.05)

            own.stop()
            async with asyncio.timeout(30):  # a reconnect that never comes fails, not hangs
                while app.state.nats.is_connected:
                    await asyncio.sleep(0.05)
            unsent = await api.post("/memory-entries", json={"memory_id": memory["id"], "content": "Never sent"})
            assert unsent.status_code == 503 and "was not sent" in unsent.json()["error"]["message"], unsent.text
            assert "meta" not in unsent.json()["error"]
            own.start()  # the API's client reconnects, so that it can close cleanly
            async with asyncio.timeout(30):  # a reconnect that never comes fails, not hangs
                while not app.state.nats.is_connected:
                    await asyncio.sleep(0.05)


async def test_an_edit_or_delete_does_not_wait_for_the_bus_to_come_back(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], tmp_path: Path
) -> None:
    # The change is committed; its announcement on the change feed waited for the bus's acknowledgement, so every
    # edit and delete answered only after ~5 s while NATS was away.
    async with sessions.begin() as session:
        entry_ids = [await repo.insert_entry(
            session, memory_id=memory["id"], project_id=memory["project_id"], content=f"Stored fact {n}",
            content_hash=f"h{n}", embedding=[1.0] + [0.0] * 383, embedding_model="m", source_type="manual", tags=None,
            metadata_=None, source_generation_id=None, source_conversation_id=None,
        ) for n in range(2)]
    with EmbeddedNats(tmp_path / "nats") as own:
        async with open_api(settings.model_copy(update={"nats_url": own.url})) as (app, api):
            own.stop()
            async with asyncio.timeout(30):  # a reconnect that never comes fails, not hangs
                while app.state.nats.is_connected:
                    await asyncio.sleep(0.05)
            edited = await asyncio.wait_for(api.put(f"/memory-entries/{entry_ids[0]}", json={"tags": ["edited"]}), 3)
            deleted = await asyncio.wait_for(api.delete(f"/memory-entries/{entry_ids[1]}"), 3)
            assert (edited.status_code, deleted.status_code) == (200, 204)
            own.start()  # the API's client reconnects, and sends what it buffered meanwhile
            async with asyncio.timeout(30):  # a reconnect that never comes fails, not hangs
                while not app.state.nats.is_connected:
                    await asyncio.sleep(0.05)
            # Announced all the same once the bus is back (skipped while it was away, a short reconnect lost them).
            async with asyncio.timeout(15):
                while (await app.state.nats.jetstream().stream_info(bus.EVENTS_STREAM)).state.messages < 2:
                    await asyncio.sleep(0.1)


async def test_a_rest_write_refused_while_the_embedder_is_down_is_the_contracts_503(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with open_api(settings) as (app, api):
        app.state.gateway = WriterWithoutEmbedder(sessions)
        response = await api.post("/memory-entries", json={"memory_id": memory["id"], "content": "Unembeddable now"})
        assert response.status_code == 503
        error = response.json()["error"]
        # The contract's code, whatever the writer calls it; the write can be looked up by its id.
        assert error["code"] == "SERVICE_UNAVAILABLE" and "provider down" in error["message"]
        status = (await api.get(f"/memory-writes/{error['meta']['write_id']}")).json()
    assert status["status"] == "failed" and status["error"]["code"] == "EMBEDDING_UNAVAILABLE"


async def test_a_write_to_a_deleted_memory_fails_cleanly(
    client: httpx.AsyncClient, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    async def unused(_texts: Any) -> list[list[float]]:
        return [[0.0] * 384]

    await client.delete(f"/memories/{memory['id']}")
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Too late"
    )
    applied = await WriteApplier(sessions, unused, "m").apply(event)
    assert applied.outcome.error is not None and applied.outcome.error.status == 404


async def test_malformed_write_events_are_dead_lettered(settings: Settings, writers: list[Any]) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(f"{bus.DEAD_LETTER_ROOT}.writer", stream=bus.DEAD_LETTER_STREAM, deliver_policy=nats.js.api.DeliverPolicy.NEW)
        subject = bus.write_subject("mem_AAAAAAAAAAAAAAAA", settings.memories_partitions)
        await js.publish(subject, b'{"not": "an event"}', stream=bus.WRITES_STREAM)
        message = await dead.next_msg(timeout=10)
        envelope = json.loads(message.data)
        assert envelope["origin_subject"] == subject and "invalid write event" in envelope["reason"]
        await dead.unsubscribe()
    finally:
        await nc.close()


async def test_a_keyed_write_the_writer_cannot_read_is_failed_not_left_pending(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # What an API of a newer version could publish to an older writer: a claimed write whose event does not
    # validate here (a source type this writer does not know).
    write_id = new_write_id()
    async with sessions() as session:
        await write_records.claim_write_id(session, write_id, memory["project_id"], memory["id"])
        await session.commit()
    failures = metrics.REGISTRY.get_sample_value("memories_write_failures_total", {"code": "INTERNAL_ERROR"}) or 0.0
    inbox = f"_INBOX.unreadable.{write_id}"
    body = {"event_id": write_id, "project_id": memory["project_id"], "memory_id": memory["id"],
            "content": "From the future", "source_type": "telepathy", "reply_subject": inbox}
    nc = await nats.connect(settings.nats_url)
    try:
        replies = await nc.subscribe(inbox)
        await nc.jetstream().publish(
            bus.write_subject(memory["id"], settings.memories_partitions), json.dumps(body).encode(), stream=bus.WRITES_STREAM
        )
        # The waiting caller is answered at once instead of after its timeout (a 202 pending for ever).
        reply = json.loads((await replies.next_msg(timeout=15)).data)
    finally:
        await nc.close()
    assert reply["write_id"] == write_id and reply["error"]["code"] == "INTERNAL_ERROR"
    assert metrics.REGISTRY.get_sample_value("memories_write_failures_total", {"code": "INTERNAL_ERROR"}) == failures + 1
    status = (await client.get(f"/memory-writes/{write_id}")).json()
    assert status["status"] == "failed" and "set aside for an operator" in status["error"]["message"]
    # A retry with the key owns the write again (here: it is refused the same way, never applied twice).
    async with sessions() as session:
        _, owned = await write_records.claim_write_id(session, write_id, memory["project_id"], memory["id"])
        await session.rollback()
    assert owned
    # A reply subject as broken as the rest of the event: no answer, but the status is still set.
    broken = {**body, "event_id": new_write_id(), "reply_subject": "not a subject"}
    async with sessions() as session:
        await write_records.claim_write_id(session, broken["event_id"], memory["project_id"], memory["id"])
        await session.commit()
    nc = await nats.connect(settings.nats_url)
    try:
        await nc.jetstream().publish(
            bus.write_subject(memory["id"], settings.memories_partitions), json.dumps(broken).encode(), stream=bus.WRITES_STREAM
        )
    finally:
        await nc.close()
    for _ in range(100):
        if (await client.get(f"/memory-writes/{broken['event_id']}")).json()["status"] == "failed":
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the write with a broken reply subject stayed pending")
    # And the partition goes on: the next write to the memory is decided.
    after = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Decided after it"})
    assert after.status_code == 201, after.text


async def test_an_unreadable_event_fails_only_a_pending_record_of_its_own_memory(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    pending, applied = new_write_id(), new_write_id()
    async with sessions.begin() as session:
        await write_records.claim_write_id(session, pending, memory["project_id"], memory["id"])
        await write_records.save_records(
            session, [write_records.OutcomeRow(applied, memory["project_id"], memory["id"], "applied", "created", "e")], []
        )
    async with sessions.begin() as session:
        assert not await write_records.fail_pending_write(session, applied, memory["id"], "INTERNAL_ERROR", "x")
        assert not await write_records.fail_pending_write(session, pending, "mem_another", "INTERNAL_ERROR", "x")
        assert not await write_records.fail_pending_write(session, new_write_id(), memory["id"], "INTERNAL_ERROR", "x")
        assert await write_records.fail_pending_write(session, pending, memory["id"], "INTERNAL_ERROR", "x")
    async with sessions() as session:
        stored = {w: await session.get(WriteOutcome, w) for w in (pending, applied)}
    assert stored[applied] is not None and stored[applied].status == "applied"
    assert stored[pending] is not None and (stored[pending].status, stored[pending].failed_attempts) == ("failed", 1)


async def test_change_feed_announces_created_entries(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any]
) -> None:
    nc = await nats.connect(settings.nats_url)
    try:
        sub = await nc.subscribe(bus.event_subject(memory["project_id"], "created"))
        await nc.flush()  # subscribed on the server before another connection publishes
        entry = (await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Announced"})).json()
        message = await sub.next_msg(timeout=10)
        payload = json.loads(message.data)
        assert payload["entry_id"] == entry["id"] and payload["kind"] == "created"
        assert payload["write_id"] == entry["write_id"]
    finally:
        await nc.close()


async def test_a_write_event_naming_another_projects_memory_is_rejected_and_dead_lettered(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    intruder = (await client.post("/projects", json={"name": "intruder"})).json()
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=intruder["id"], memory_id=memory["id"], content="Injected fact"
    )
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(f"{bus.DEAD_LETTER_ROOT}.writer", stream=bus.DEAD_LETTER_STREAM,
                                  deliver_policy=nats.js.api.DeliverPolicy.NEW)
        await _publish_raw(settings, event, event.write_id)
        letter = json.loads((await dead.next_msg(timeout=10)).data)
        assert "another project" in letter["reason"] and json.loads(letter["body"])["event_id"] == event.write_id
        await dead.unsubscribe()
    finally:
        await nc.close()
    assert await count_entries(sessions, memory["id"]) == 0
    async with sessions() as session:
        stored = await session.get(WriteOutcome, event.write_id)
    assert stored is not None and stored.status == "failed" and stored.error_code == "RESOURCE_NOT_FOUND"


async def test_change_feed_announces_edits_and_deletions(
    client: httpx.AsyncClient, settings: Settings, memory: dict[str, Any]
) -> None:
    entry = (await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Edited later"})).json()
    nc = await nats.connect(settings.nats_url)
    try:
        sub = await nc.subscribe(f"{bus.EVENT_SUBJECT_ROOT}.{memory['project_id']}.*")
        await nc.flush()  # subscribed on the server before another connection publishes
        await client.put(f"/memory-entries/{entry['id']}", json={"content": "Edited now"})
        await client.delete(f"/memory-entries/{entry['id']}")
        kinds = [json.loads((await sub.next_msg(timeout=10)).data) for _ in range(2)]
        assert [(k["kind"], k["entry_id"]) for k in kinds] == [("updated", entry["id"]), ("deleted", entry["id"])]
    finally:
        await nc.close()


async def test_a_failure_recorded_while_another_delivery_applies_the_write_keeps_the_applied_outcome(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    async def unused(_texts: Any) -> list[list[float]]:
        raise AssertionError("not called")

    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Raced"
    )
    applied = write_records.OutcomeRow(event.write_id, event.project_id, event.memory_id, "applied", "created", "mem_entry_x")
    async with sessions.begin() as session:
        # Another delivery of the same write is deciding it under the memory's lock.
        await repo.lock_memory(session, memory["id"])
        failing = asyncio.create_task(WriteApplier(sessions, unused, "m").record_failure(event, "INTERNAL_ERROR", "x"))
        await wait_until_blocked_by(session, "recording the failure")
        await write_records.save_records(session, [applied], [])
    result = await failing
    assert result.replayed and result.outcome.action == "created"
    async with sessions() as session:
        stored = await session.get(WriteOutcome, event.write_id)
    assert stored is not None and stored.status == "applied"


async def test_a_caller_waiting_on_a_claim_its_owner_gave_up_publishes_the_write_itself(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], writers: list[Any]
) -> None:
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Parcels leave at noon"
    )
    async with sessions() as session:  # another request with the same key owns the write
        claim, _owned = await write_records.claim_write_id(session, event.write_id, memory["project_id"], memory["id"])
        claimed_at = claim.updated_at
        await session.commit()
    nc = await nats.connect(settings.nats_url)
    gateway = WriteGateway(nc, sessions, settings.memories_partitions)
    await gateway.start()
    try:
        waiting = asyncio.create_task(gateway.submit(event, timeout=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        async with sessions() as session:  # its owner could not publish (NATS down): a 503, and the claim given up
            await write_records.release_write_claim(session, event.write_id, claimed_at)
            await session.commit()
        # Before, this caller waited out its timeout and answered 202 for a write nobody had published.
        outcome = await waiting
    finally:
        await nc.close()
    assert outcome is not None and outcome.action is not None and outcome.action.value == "created"


async def test_a_retry_waits_for_its_queued_write_instead_of_publishing_it_again(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past the bus's duplicate window (2 minutes), each retry of a key whose claim had gone stale (30 s) queued one
    # more copy of the write while no writer ran.
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Queued, unread"
    )
    published: list[str] = []
    publish = bus.publish_or_refuse

    async def counted(nc: Any, subject: str, *args: Any, **kwargs: Any) -> Any:
        published.append(subject)
        return await publish(nc, subject, *args, **kwargs)

    async def age_claim(by: timedelta) -> None:
        async with sessions() as session:
            await session.execute(
                update(WriteOutcome)
                .where(WriteOutcome.write_id == event.write_id)
                .values(updated_at=WriteOutcome.updated_at - by, published_at=WriteOutcome.published_at - by)
            )
            await session.commit()

    monkeypatch.setattr(bus, "publish_or_refuse", counted)
    # Counted so that the memory's partition is one no writer consumes: the write stays queued.
    unread = next(n for n in itertools.count(settings.memories_partitions + 1)
                  if bus.partition_of(memory["id"], n) >= settings.memories_partitions)
    nc = await nats.connect(settings.nats_url)
    gateway = WriteGateway(nc, sessions, unread)
    await gateway.start()
    try:
        assert await gateway.submit(event, timeout=0.5, client_key=True) is None  # a 202: queued
        await age_claim(2 * write_records.STALE_PENDING)
        assert await gateway.submit(event, timeout=0.5, client_key=True) is None
        assert len(published) == 1  # waited for, not published again
        await age_claim(write_records.STALE_PUBLISHED)  # lost from the stream, perhaps: after so long, published again
        assert await gateway.submit(event, timeout=0.5, client_key=True) is None
        assert len(published) == 2
    finally:
        if published:
            await nc.jetstream().purge_stream(bus.WRITES_STREAM, subject=published[0])
        await nc.close()


async def test_a_late_record_or_release_of_a_claim_leaves_a_newer_claim_alone(
    memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # A caller timed out, the writer failed its attempt, a retry claimed the write again: the first caller's late
    # record of its publish made the retry's claim look queued, and retries waited an hour for an unpublished write.
    write_id = new_write_id()

    async def claim() -> datetime:
        async with sessions() as session:
            record, owned = await write_records.claim_write_id(session, write_id, memory["project_id"], memory["id"])
            assert owned
            claimed_at = record.updated_at
            await session.commit()
        return claimed_at

    async def published_at() -> datetime | None:
        async with sessions() as session:
            return await session.scalar(select(WriteOutcome.published_at).where(WriteOutcome.write_id == write_id))

    first = await claim()
    async with sessions() as session:
        assert await write_records.fail_pending_write(session, write_id, memory["id"], "EMBEDDING_UNAVAILABLE", "down")
        await session.commit()
    retried = await claim()
    for claimed_at, recorded in ((first, False), (retried, True)):
        async with sessions() as session:
            await write_records.record_published(session, write_id, claimed_at)
            await session.commit()
        assert (await published_at() is not None) == recorded
    async with sessions() as session:  # the first caller's late release: not its claim any more
        await write_records.release_write_claim(session, write_id, first)
        await session.commit()
    assert await published_at() is not None
    async with sessions() as session:  # the retry's publish refused after all: the next retry publishes at once
        await write_records.release_write_claim(session, write_id, retried)
        await session.commit()
    assert await published_at() is None
    await claim()


async def test_a_caller_waiting_on_another_callers_attempt_reads_its_record_less_and_less_often(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], writers: list[Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Read every 50 ms for the whole timeout: an extraction's facts re-asked while the writer was down made
    # thousands of queries a second.
    event = MemoryWriteRequested(
        event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content="Waiting for it"
    )
    async with sessions() as session:  # another caller owns the attempt, and never finishes it
        await write_records.claim_write_id(session, event.write_id, memory["project_id"], memory["id"])
        await session.commit()
    reads = []
    read = write_records.get_write_outcome

    async def counted(session: AsyncSession, write_id: str) -> Any:
        reads.append(write_id)
        return await read(session, write_id)

    monkeypatch.setattr(write_records, "get_write_outcome", counted)
    nc = await nats.connect(settings.nats_url)
    gateway = WriteGateway(nc, sessions, settings.memories_partitions)
    await gateway.start()
    try:
        assert await gateway.submit(event, timeout=3) is None  # still pending: a 202
    finally:
        await nc.close()
    assert 3 <= reads.count(event.write_id) <= 12  # 60 at a fixed 50 ms


async def test_a_write_failed_for_good_is_not_tried_again_by_a_caller_that_retries_only_refusals(
    settings: Settings, memory: dict[str, Any], sessions: async_sessionmaker[AsyncSession], writers: list[Any]
) -> None:
    # The extractor's resubmission of a turn's facts: a fact the writer set aside for an operator, resubmitted,
    # was failed again every ~40 s while the turn waited for it for ever.
    def fact(content: str) -> MemoryWriteRequested:
        return MemoryWriteRequested(
            event_id=new_write_id(), project_id=memory["project_id"], memory_id=memory["id"], content=content
        )

    given_up, refused = fact("Set aside for an operator"), fact("Refused while the embedder was down")
    async with sessions() as session:
        for event, code in ((given_up, "INTERNAL_ERROR"), (refused, "EMBEDDING_UNAVAILABLE")):
            await write_records.claim_write_id(session, event.write_id, event.project_id, event.memory_id)
            assert await write_records.fail_pending_write(session, event.write_id, event.memory_id, code, "failed")
        await session.commit()
    nc = await nats.connect(settings.nats_url)
    gateway = WriteGateway(nc, sessions, settings.memories_partitions)
    await gateway.start()
    try:
        final = await gateway.submit(given_up, timeout=10, retry_failed=REFUSED_FOR_NOW)
        retried = await gateway.submit(refused, timeout=10, retry_failed=REFUSED_FOR_NOW)
        again = await gateway.submit(given_up, timeout=10)  # a client retrying its key tries any failure again
    finally:
        await nc.close()
    assert final is not None and final.error is not None and final.error.code == "INTERNAL_ERROR"
    assert retried is not None and retried.action is not None and retried.action.value == "created"
    assert again is not None and again.action is not None and again.action.value == "created"


def test_a_caller_waits_for_its_write_less_than_a_retry_waits_to_take_it_over() -> None:
    # Longer, and a retry with the same key would republish the write while its first caller still waits for it.
    assert timedelta(seconds=bus.PUBLISH_TIMEOUT_S + WRITE_TIMEOUT_MAX_S) < write_records.STALE_PENDING
    with pytest.raises(ValidationError):
        Settings(memories_write_timeout_s=WRITE_TIMEOUT_MAX_S + 1)
    assert Settings(memories_write_timeout_s=WRITE_TIMEOUT_MAX_S).memories_write_timeout_s == WRITE_TIMEOUT_MAX_S


async def test_an_outage_is_waited_out_in_place_and_no_write_is_handed_back(
    client: httpx.AsyncClient, memory: dict[str, Any], writers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Handed back, each write would come back after a backoff grown with its own deliveries: out of order.
    down = iter(range(3))
    decide_batch = WriteApplier._decide_batch

    async def restarting_database(self: WriteApplier, session: Any, batch: Any, **options: Any) -> Any:
        if next(down, None) is not None:
            raise OperationalError("SELECT 1", {}, ConnectionError("the database system is starting up"))
        return await decide_batch(self, session, batch, **options)

    handed_back: list[str] = []
    nak = Msg.nak

    async def counted_nak(message: Msg, *args: Any, **kwargs: Any) -> None:
        handed_back.append(message.subject)
        await nak(message, *args, **kwargs)

    monkeypatch.setattr(WriteApplier, "_decide_batch", restarting_database)
    monkeypatch.setattr(Msg, "nak", counted_nak)
    written = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Written after the outage"})
    assert written.status_code == 201, written.text
    assert next(down, None) is None and handed_back == []


async def test_a_write_event_leaves_unset_optional_fields_off_the_wire(
    settings: Settings, client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # A field added to the event then reaches a writer of the previous version only when it is used: rolling
    # upgrades do not dead-letter every write while the API is ahead of the writers.
    nc = await nats.connect(settings.nats_url)
    try:
        seen = await nc.subscribe(f"{bus.WRITE_SUBJECT_ROOT}.>")
        await nc.flush()  # the server has the subscription before the write is published (else it may miss it)
        await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "On the wire as little as needed"})
        payload = json.loads((await seen.next_msg(timeout=5)).data)
    finally:
        await nc.close()
    assert payload["content"] == "On the wire as little as needed"
    assert None not in payload.values() and "sources_seen_at" not in payload
