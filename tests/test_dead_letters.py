"""Dead letters end to end: a poison write lands in DEAD_LETTERS, `memories dlq list` shows it, and `memories
dlq replay` puts a dead letter back on its original subject, where a valid write is then applied once.

Each test has its own NATS server (so DEAD_LETTERS holds only its letters) and an in-process writer on it;
the database is the session's.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest_asyncio
from nats.js import JetStreamContext
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.writer.main import Writer
from shared import bus, bus_connection, dead_letters, metrics
from shared import repository as repo
from shared.db.models import EntryHistory, MemoryEntry, WriteOutcome
from shared.events import MemoryWriteRequested
from shared.ids import new_write_id
from shared.servers import EmbeddedNats, free_port, nats_server_binary
from shared.settings import Settings
from tests.conftest import make_settings


@dataclass
class Bus:
    settings: Settings
    js: JetStreamContext
    memory_id: str
    project_id: str

    def write_subject(self) -> str:
        return bus.write_subject(self.memory_id, self.settings.memories_partitions)

    def write(self, content: str) -> MemoryWriteRequested:
        """A new write of `content` to this bus's memory."""
        return MemoryWriteRequested(
            event_id=new_write_id(), project_id=self.project_id, memory_id=self.memory_id, content=content
        )

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NATS_URL": self.settings.nats_url or ""}
        return subprocess.run([sys.executable, "-m", "services.cli", "dlq", *args], env=env, capture_output=True,
                              text=True, timeout=60, check=False)


@pytest_asyncio.fixture
async def dlq_bus(
    server_urls: tuple[str, str], sessions: async_sessionmaker[AsyncSession]
) -> AsyncIterator[Bus]:
    root = Path(tempfile.mkdtemp(prefix="memories-dlq-"))
    nats_server = EmbeddedNats(root / "nats")
    writer: Writer | None = None
    try:
        settings = make_settings((server_urls[0], nats_server.start()))
        writer = Writer(settings)
        await writer.start()
        async with sessions.begin() as session:
            project = await repo.create_project(session, "dead letters")
            memory = await repo.create_memory(session, project_id=project.id, name="dlq", description=None,
                                              tags=None, write_policy="seed")
        nc = await bus_connection.connect(settings.nats_url or "", name="dlq-test")
        try:
            yield Bus(settings, nc.jetstream(), memory.id, project.id)
        finally:
            await nc.close()
    finally:
        if writer is not None:
            await writer.stop()
        nats_server.stop()
        shutil.rmtree(root, ignore_errors=True)


async def wait_for_letters(js: JetStreamContext, count: int, timeout: float = 15) -> list[dead_letters.StoredDeadLetter]:
    deadline = time.monotonic() + timeout
    while len(letters := await dead_letters.list_dead_letters(js)) < count:
        assert time.monotonic() < deadline, f"{len(letters)} dead letters, expected {count}"
        await asyncio.sleep(0.1)
    return letters


async def wait_applied(sessions: async_sessionmaker[AsyncSession], write_id: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while True:
        async with sessions() as session:
            outcome = await session.get(WriteOutcome, write_id)
        if outcome is not None and outcome.status == "applied":
            return
        assert time.monotonic() < deadline, f"write {write_id} not applied"
        await asyncio.sleep(0.1)


async def wait_writes_consumed(js: JetStreamContext, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (await js.stream_info(bus.WRITES_STREAM)).state.messages:
        assert time.monotonic() < deadline, "the writer did not consume MEMORY_WRITES"
        await asyncio.sleep(0.1)


async def test_a_poison_write_is_dead_lettered_listed_and_replayed(dlq_bus: Bus) -> None:
    subject = dlq_bus.write_subject()
    await dlq_bus.js.publish(subject, b'{"content": "half an event', stream=bus.WRITES_STREAM)
    (letter,) = await wait_for_letters(dlq_bus.js, 1)
    assert (letter.origin, letter.origin_subject) == ("writer", subject)
    assert letter.body == '{"content": "half an event' and "invalid write event" in letter.reason

    listed = dlq_bus.cli("list", "--json")
    assert listed.returncode == 0, listed.stderr
    (shown,) = [json.loads(line) for line in listed.stdout.splitlines()]
    assert shown["sequence"] == letter.sequence and shown["origin_subject"] == subject
    table = dlq_bus.cli("list", "--origin", "writer")
    assert str(letter.sequence) in table.stdout and subject in table.stdout
    assert "no dead letters" in dlq_bus.cli("list", "--origin", "extractor").stdout

    replayed = dlq_bus.cli("replay", str(letter.sequence))
    assert replayed.returncode == 0, replayed.stderr
    assert f"replayed {letter.sequence} -> {subject} ({bus.WRITES_STREAM})" in replayed.stdout
    # Nothing fixed it, so the writer parks it again: a new letter, the same message, the old one gone.
    letters = await wait_for_letters(dlq_bus.js, 1)
    assert [(again.origin_subject, again.body) for again in letters] == [(subject, letter.body)]
    assert letters[0].sequence > letter.sequence
    # No version will take it: deleted, so that the dead-letter alert stops (it stayed for the stream's 30 days).
    deleted = dlq_bus.cli("delete", str(letters[0].sequence), str(letters[0].sequence + 100))
    assert deleted.returncode == 1 and f"deleted {letters[0].sequence}" in deleted.stdout
    assert f"not deleted {letters[0].sequence + 100}: no such dead letter" in deleted.stderr
    assert await dead_letters.list_dead_letters(dlq_bus.js) == []


async def test_replaying_a_dead_lettered_valid_write_applies_it_once(
    dlq_bus: Bus, sessions: async_sessionmaker[AsyncSession]
) -> None:
    event = dlq_bus.write("The warehouse closes at six on Fridays")
    body = event.model_dump_json().encode()
    # As the writer parks a write that kept failing (e.g. the database was down for every delivery).
    for _ in range(2):
        await bus.dead_letter(dlq_bus.js, "writer", dlq_bus.write_subject(), body, reason="gave up after 5: down")
    first, second = await wait_for_letters(dlq_bus.js, 2)

    results = await dead_letters.replay(dlq_bus.js, [first.sequence])
    assert [(r.sequence, r.stream, r.ok) for r in results] == [(first.sequence, bus.WRITES_STREAM, True)]
    await wait_applied(sessions, event.write_id)
    assert [letter.sequence for letter in await dead_letters.list_dead_letters(dlq_bus.js)] == [second.sequence]
    (gone,) = await dead_letters.replay(dlq_bus.js, [first.sequence])
    assert not gone.ok and gone.error == "no such dead letter"

    # The same write replayed twice (a second copy, or a crash between publish and delete): one effect.
    replayed = dlq_bus.cli("replay", str(second.sequence))
    assert replayed.returncode == 0, replayed.stderr
    await wait_writes_consumed(dlq_bus.js)  # acknowledged, so the writer has decided it (again)
    async with sessions() as session:
        entries = await session.scalar(select(func.count()).where(MemoryEntry.memory_id == dlq_bus.memory_id))
        history = await session.scalar(select(func.count()).where(EntryHistory.write_id == event.write_id))
    assert (entries, history) == (1, 1)
    assert await dead_letters.list_dead_letters(dlq_bus.js) == []


async def test_a_write_dead_lettered_before_the_partition_count_changed_is_replayed_to_its_partition_now(
    dlq_bus: Bus, sessions: async_sessionmaker[AsyncSession]
) -> None:
    event = dlq_bus.write("Parcels are collected at noon")
    old_subject = f"{bus.WRITE_SUBJECT_ROOT}.{dlq_bus.settings.memories_partitions + 20}.{dlq_bus.memory_id}"
    await bus.dead_letter(dlq_bus.js, "writer", old_subject, event.model_dump_json().encode(), reason="gave up")
    (letter,) = await wait_for_letters(dlq_bus.js, 1)
    (replayed,) = await dead_letters.replay(dlq_bus.js, [letter.sequence])
    assert replayed.ok and replayed.subject == dlq_bus.write_subject()
    await wait_applied(sessions, event.write_id)


async def test_replay_all_of_one_origin_and_letters_that_cannot_be_replayed(dlq_bus: Bus) -> None:
    extractor_subject = bus.generation_completed_subject(dlq_bus.project_id)
    await bus.dead_letter(dlq_bus.js, "extractor", extractor_subject, b"{}", reason="invalid event")
    await dlq_bus.js.publish(bus.dead_letter_subject("writer"), b"not an envelope", stream=bus.DEAD_LETTER_STREAM)
    await bus.dead_letter(dlq_bus.js, "writer", "somewhere.else", b"{}", reason="test")
    extractor_letter, unreadable, elsewhere = await wait_for_letters(dlq_bus.js, 3)
    assert unreadable.reason == "unreadable dead-letter envelope" and unreadable.body == "not an envelope"
    assert elsewhere.origin_subject == "somewhere.else"
    assert [letter.sequence for letter in await dead_letters.list_dead_letters(dlq_bus.js, limit=2)] == [
        extractor_letter.sequence, unreadable.sequence]

    replayed = dlq_bus.cli("replay", "--all", "--origin", "writer")
    assert replayed.returncode == 1  # some could not be replayed
    assert "0 replayed, 2 not replayed" in replayed.stdout
    assert "no stream takes the original subject" in replayed.stderr
    assert len(await dead_letters.list_dead_letters(dlq_bus.js)) == 3  # left as they were

    stream_before = (await dlq_bus.js.stream_info(bus.GENERATIONS_STREAM)).state.messages
    (result,) = await dead_letters.replay_all(dlq_bus.js, origin="extractor")
    assert result.ok and (result.subject, result.stream) == (extractor_subject, bus.GENERATIONS_STREAM)
    assert (await dlq_bus.js.stream_info(bus.GENERATIONS_STREAM)).state.messages == stream_before + 1
    assert [letter.origin for letter in await dead_letters.list_dead_letters(dlq_bus.js)] == ["writer", "writer"]

    assert dlq_bus.cli("replay").returncode == 2  # neither sequences nor --all
    assert dlq_bus.cli("replay", "1", "--origin", "writer").returncode == 2
    for sequence in ("0", "-5"):  # sequences start at 1: a usage error, not NATS' raw refusal
        refused = dlq_bus.cli("replay", "1", sequence)
        assert refused.returncode == 2 and "a sequence is 1 or more" in refused.stderr


def _failures() -> float:
    return metrics.REGISTRY.get_sample_value("memories_write_failures_total", {"code": "INTERNAL_ERROR"}) or 0.0


async def test_a_write_the_database_keeps_refusing_ends_failed_not_pending(
    dlq_bus: Bus, sessions: async_sessionmaker[AsyncSession]
) -> None:
    # The database refuses this memory's new entries, as it would a value that slipped past validation.
    async with sessions.begin() as session:
        await session.execute(text(
            "CREATE FUNCTION refuse_entry() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused by the test'; END $$"))
        await session.execute(text(
            "CREATE TRIGGER refuse_entry BEFORE INSERT ON memory_entries FOR EACH ROW "
            f"WHEN (NEW.memory_id = '{dlq_bus.memory_id}') EXECUTE FUNCTION refuse_entry()"))
    failures = _failures()
    try:
        event = dlq_bus.write("The dock opens at five")
        await dlq_bus.js.publish(dlq_bus.write_subject(), event.model_dump_json().encode(), stream=bus.WRITES_STREAM)
        (letter,) = await wait_for_letters(dlq_bus.js, 1)
        assert "gave up after 3" in letter.reason
        deadline = time.monotonic() + 15  # recorded just after the dead letter is parked
        while True:
            async with sessions() as session:
                outcome = await session.get(WriteOutcome, event.write_id)
            if (outcome is not None and outcome.status == "failed") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert outcome is not None and outcome.status == "failed" and outcome.error_code == "INTERNAL_ERROR"
        assert "set aside for an operator" in (outcome.error_message or "")
        assert _failures() == failures + 1  # once, not per try
    finally:
        async with sessions.begin() as session:
            await session.execute(text("DROP TRIGGER refuse_entry ON memory_entries"))
            await session.execute(text("DROP FUNCTION refuse_entry()"))


def test_one_shot_commands_give_up_on_an_unreachable_bus() -> None:
    env = {**os.environ, "NATS_URL": f"nats://127.0.0.1:{free_port()}"}  # nothing listens there
    for command in (["bus", "init"], ["dlq", "list"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "services.cli", *command], env=env, capture_output=True,
                              text=True, timeout=120, check=False)
        assert done.returncode == 1, (command, done.stdout, done.stderr)
        assert "cannot reach NATS" in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert time.monotonic() - started < 60, command


def test_a_negative_dlq_limit_or_a_sequence_that_is_no_number_is_a_usage_error() -> None:
    for command, said in ((["list", "--limit", "-1"], "must be 0 or more"),
                          (["replay", "abc"], "'abc' is not a whole number")):  # was "invalid _sequence value"
        done = subprocess.run([sys.executable, "-m", "services.cli", "dlq", *command],
                              capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 2 and said in done.stderr, done.stderr


def test_one_shot_commands_say_when_the_bus_has_no_jetstream() -> None:
    """nats-py's error for it read "ServiceUnavailableError: code=None err_code=None description='None'"."""
    port = free_port()
    plain = subprocess.Popen([str(nats_server_binary()), "-a", "127.0.0.1", "-p", str(port)],  # no -js
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = {**os.environ, "NATS_URL": f"nats://user:secret@127.0.0.1:{port}"}
        done = subprocess.run([sys.executable, "-m", "services.cli", "dlq", "list"], env=env, capture_output=True,
                              text=True, timeout=60, check=False)
        assert done.returncode == 1, (done.stdout, done.stderr)
        assert "JetStream is not available" in done.stderr and "-js" in done.stderr, done.stderr
        assert "secret" not in done.stderr and "Traceback" not in done.stderr
    finally:
        plain.terminate()
        plain.wait(10)
