"""The bus layout's pure parts: partitioning, retry policy, what counts as an outage."""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats.errors
import psycopg.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, RetentionPolicy, StreamConfig
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from shared import bus, bus_admin, bus_connection
from shared.consumer_process import ConsumerProcess
from shared.servers import EmbeddedNats
from shared.settings import Settings


def test_partition_is_crc32_mod_n_and_stable() -> None:
    memory_id = "mem_AAAAAAAAAAAAAAAA"
    assert bus.partition_of(memory_id, 16) == zlib.crc32(memory_id.encode()) % 16
    assert bus.write_subject(memory_id, 16) == f"memories.write.{zlib.crc32(memory_id.encode()) % 16}.{memory_id}"
    spread = {bus.partition_of(f"mem_{i:016d}", 16) for i in range(500)}
    assert spread == set(range(16))


def test_writer_consumers_allow_one_batch_in_flight_per_partition() -> None:
    plan = bus.layout(Settings(memories_partitions=4, memories_write_batch=24))
    writers = [consumer.config for consumer in plan.consumers_of(bus.Role.WRITER) if consumer.stream == bus.WRITES_STREAM]
    assert [c.filter_subject for c in writers] == [f"memories.write.{p}.*" for p in range(4)]
    assert all(c.max_ack_pending == 2 * 24 and c.max_deliver == -1 for c in writers)  # one deciding, one preparing


@pytest.mark.parametrize(
    ("error", "outage"),
    [
        (OperationalError("SELECT 1", {}, Exception("connection refused")), True),
        (OperationalError("SELECT 1", {}, psycopg.errors.AdminShutdown("terminating connection")), True),
        (OperationalError("SELECT 1", {}, psycopg.errors.TooManyConnections("too many clients")), True),
        (OperationalError("SELECT 1", {}, psycopg.errors.ConnectionFailure("connection failure")), True),
        # The statement's own failure, not the database's: a statement timeout on a query that always takes too
        # long would hold its partition for ever.
        (OperationalError("SELECT 1", {}, psycopg.errors.QueryCanceled("statement timeout")), False),
        (OperationalError("SELECT 1", {}, psycopg.errors.ProgramLimitExceeded("index row too large")), False),
        # Any error that took the connection with it is one (an I/O error, a conflict with recovery).
        (OperationalError("SELECT 1", {}, psycopg.errors.IoError("could not read block"), connection_invalidated=True),
         True),
        (DBAPIError("SELECT 1", {}, Exception("server closed"), connection_invalidated=True), True),
        (ConnectionRefusedError(), True),
        (TimeoutError(), True),
        (nats.errors.ConnectionClosedError(), True),
        (IntegrityError("INSERT", {}, Exception("duplicate key")), False),
        (ValueError("a bug"), False),
        (KeyError("x"), False),
    ],
)
def test_what_counts_as_an_outage(error: BaseException, outage: bool) -> None:
    assert bus.is_outage(error) is outage


def test_every_consumer_retries_an_outage_for_ever_and_anything_else_max_deliver_times() -> None:
    outage, bug = ConnectionRefusedError(), ValueError("a bug")
    assert bus.retried(50, 5, outage) and bus.retried(4, 5, bug) and not bus.retried(5, 5, bug)
    assert bus.retried(4, 5) and not bus.retried(5, 5)  # a consumer that waited its outages out already
    assert bus.deliveries(SimpleNamespace(metadata=None)) == 1  # type: ignore[arg-type]
    assert bus.deliveries(SimpleNamespace(metadata=SimpleNamespace(num_delivered=3))) == 3  # type: ignore[arg-type]


@asynccontextmanager
async def connected_bus(tmp_path: Path, name: str) -> AsyncIterator[NatsClient]:
    """A NATS server of the test's own, and a connection to it."""
    with EmbeddedNats(tmp_path / "nats") as server:
        nc = await bus_connection.connect(server.url, name=name)
        try:
            yield nc
        finally:
            await nc.close()


def test_retry_delay_doubles_and_is_capped() -> None:
    assert [bus.retry_delay(0.5, n) for n in (1, 2, 3)] == [1.0, 2.0, 4.0]
    assert bus.retry_delay(1.0, 50) == 30.0


async def test_a_service_configured_for_another_partition_count_than_the_bus_refuses_to_start(tmp_path: Path) -> None:
    # Its writes would land on partitions no writer consumes, or a memory's writes on two partitions.
    async with connected_bus(tmp_path, "test-partitions") as nc:
        js = nc.jetstream()
        # Nothing laid out yet: pruning says so (it said the bus was "laid out for None partitions").
        with pytest.raises(bus.PartitionCountMismatch, match="not laid out yet"):
            await bus_admin.prune_consumers(js, Settings(memories_partitions=8))
        await bus.ensure_layout(js, Settings(memories_partitions=8), bus.Role.WRITER)  # recorded on a first start
        await bus.ensure_layout(js, Settings(memories_partitions=8), bus.Role.WRITER)
        with pytest.raises(bus.PartitionCountMismatch, match="laid out for 8 partitions"):
            await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.WRITER)
        await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.ADMIN)  # `memories bus init`
        await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.WRITER)
        info = await js.stream_info(bus.WRITES_STREAM)
        assert (info.config.metadata or {})[bus.PARTITIONS_METADATA] == "4"


async def test_a_changed_stream_setting_is_applied_and_a_layout_already_in_place_updates_no_stream(
    tmp_path: Path,
) -> None:
    # A deployed service's user may not update a stream: at each start it must find nothing to update.
    async with connected_bus(tmp_path, "test-layout") as nc:
        js = nc.jetstream()
        await bus.ensure_layout(js, Settings(memories_partitions=2), bus.Role.WRITER)
        updated: list[str] = []
        update_stream = js.update_stream

        async def recorded(config: StreamConfig, **options: Any) -> Any:
            updated.append(config.name or "")
            return await update_stream(config, **options)

        js.update_stream = recorded  # type: ignore[method-assign]
        await bus.ensure_layout(js, Settings(memories_partitions=2), bus.Role.WRITER)
        assert updated == []
        await bus.ensure_layout(js, Settings(memories_partitions=2, memories_duplicate_window_s=60), bus.Role.WRITER)
        assert sorted(updated) == sorted([bus.WRITES_STREAM, bus.EVENTS_STREAM, bus.GENERATIONS_STREAM])
        assert (await js.stream_info(bus.WRITES_STREAM)).config.duplicate_window == 60
        # A window of a fraction of a second comes back off by a nanosecond: still the same layout.
        fractional = Settings(memories_partitions=2, memories_duplicate_window_s=2.106)
        await bus.ensure_layout(js, fractional, bus.Role.WRITER)
        updated.clear()
        await bus.ensure_layout(js, fractional, bus.Role.WRITER)
        assert updated == []
        # Logged in as a service's user, which may not update a stream: it says what to run, in one line.
        deployed = Settings(memories_partitions=2, memories_duplicate_window_s=90, nats_user="memories-writer")
        with pytest.raises(bus.StreamLaidOutUnlike, match="MEMORY_WRITES is laid out unlike this version "
                           r"\(duplicate_window\): run this version's `memories bus init`"):
            await bus.ensure_layout(js, deployed, bus.Role.WRITER)
        assert updated == []
        # `memories bus init` lays every stream out as its version has it, changed or not.
        await bus.ensure_layout(js, deployed, bus.Role.ADMIN)
        assert len(updated) == 4 and (await js.stream_info(bus.WRITES_STREAM)).config.duplicate_window == 90


async def test_a_service_lays_out_only_the_consumers_it_consumes(tmp_path: Path) -> None:
    # Its NATS user may manage no other (shared.bus_permissions); `memories bus init` lays out all of them.
    async with connected_bus(tmp_path, "test-own-consumers") as nc:
        js = nc.jetstream()

        async def consumers() -> set[str]:
            return {info.name for stream in (bus.WRITES_STREAM, bus.GENERATIONS_STREAM)
                    for info in await js.consumers_info(stream)}

        await bus.ensure_layout(js, Settings(memories_partitions=2), bus.Role.API)
        assert await consumers() == set()
        await bus.ensure_layout(js, Settings(memories_partitions=2), bus.Role.EXTRACTOR)
        assert await consumers() == {bus.EXTRACTOR_DURABLE}
        await bus.ensure_layout(js, Settings(memories_partitions=2), bus.Role.WRITER)
        assert await consumers() == {bus.EXTRACTOR_DURABLE, "writer-p0", "writer-p1",
                                     bus.WRITER_GENERATION_DELETIONS, bus.WRITER_CONVERSATION_DELETIONS}


def test_a_service_pulls_only_from_the_consumers_it_owns() -> None:
    class Extractor(ConsumerProcess):
        role = bus.Role.EXTRACTOR

    settings = Settings(database_url="postgresql+psycopg://memories@localhost/memories", nats_url="nats://localhost:1")
    process = Extractor(settings, pool_size=1, graceful_timeout=1.0)
    process.subscribe(bus.EXTRACTOR_DURABLE, workers=1)
    with pytest.raises(ValueError, match="writer-generation-deletions is consumed by the writer"):
        process.subscribe(bus.WRITER_GENERATION_DELETIONS, workers=1)


async def test_the_partition_count_changes_only_on_a_drained_bus_and_an_older_bus_is_read_from_its_consumers(
    tmp_path: Path,
) -> None:
    async with connected_bus(tmp_path, "test-partitions") as nc:
        js = nc.jetstream()
        # Laid out by a version that did not record the count: read from its writer partition consumers.
        await js.add_stream(StreamConfig(name=bus.WRITES_STREAM, subjects=[f"{bus.WRITE_SUBJECT_ROOT}.>"],
                                         retention=RetentionPolicy.WORK_QUEUE))
        for partition in range(6):
            await js.add_consumer(bus.WRITES_STREAM, ConsumerConfig(
                durable_name=bus.writer_durable(partition), filter_subject=bus.partition_filter(partition)))
        assert await bus.recorded_partitions(js) == 6
        with pytest.raises(bus.PartitionCountMismatch):
            await bus.ensure_layout(js, Settings(memories_partitions=8), bus.Role.WRITER)
        await bus.ensure_layout(js, Settings(memories_partitions=6), bus.Role.WRITER)
        # Their writer consumers are updated in place: served to one writer replica at a time.
        for partition in range(6):
            reply = await nc.request(f"$JS.API.CONSUMER.INFO.{bus.WRITES_STREAM}.{bus.writer_durable(partition)}", b"")
            config = json.loads(reply.data)["config"]
            assert (config["priority_policy"], config["priority_groups"]) == ("pinned_client", [bus.WRITERS_GROUP])
        # A write still queued: the count may not change under it, not even by `memories bus init`.
        await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.3.mem_queued", b"{}", stream=bus.WRITES_STREAM)
        with pytest.raises(bus.PartitionCountMismatch, match="1 writes are queued"):
            await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.ADMIN)
        await js.purge_stream(bus.WRITES_STREAM)
        # Drained for a moment, with a writer still pulling: its publishers may be running too, and what they
        # publish next would land on a partition of the old count, beyond the new one.
        pull = {"batch": 1, "expires": 1_000_000_000, "group": bus.WRITERS_GROUP}
        puller = await nc.subscribe(nc.new_inbox())  # a pull whose reply subject no one hears is dropped
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.{bus.writer_durable(5)}",
                         json.dumps(pull).encode(), reply=puller.subject)
        await nc.flush()
        with pytest.raises(bus.PartitionCountMismatch, match=r"writers still consume \(writer-p5\)"):
            await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.ADMIN)
        async with asyncio.timeout(15):  # until the pull expired: no writer consumes
            while (await js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(5))).num_waiting:
                await asyncio.sleep(0.1)
        await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.ADMIN)
        assert await bus.recorded_partitions(js) == 4


@pytest.mark.parametrize("url", ["nats://admin:S3cretNatsPw@127.0.0.1:1", "admin:S3cretNatsPw@127.0.0.1:1"])
async def test_a_one_shot_command_that_cannot_reach_nats_does_not_print_its_password(url: str) -> None:
    with pytest.raises(bus_connection.BusUnreachable) as unreachable:
        await bus_connection.connect(url, name="test", one_shot=True)
    assert "S3cretNatsPw" not in str(unreachable.value) and "127.0.0.1:1" in str(unreachable.value)


def test_the_local_run_applies_a_changed_partition_count_before_its_services_start(tmp_path: Path) -> None:
    # `memories up` owns its NATS, and nothing publishes or consumes before it starts its services: the one safe
    # moment to change the count. (A local run had no way to: `bus init` needs the NATS that only `up` starts, and
    # the services refused the new count.)
    from services.cli_bus import lay_out_for_the_local_run

    async def layout_of(url: str, queue_a_write: bool = False) -> tuple[int | None, list[str]]:
        nc = await bus_connection.connect(url, name="test-local-run")
        try:
            js = nc.jetstream()
            if queue_a_write:
                await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.2.mem_queued", b"{}", stream=bus.WRITES_STREAM)
            writers = [info.name for info in await js.consumers_info(bus.WRITES_STREAM)]
            return await bus.recorded_partitions(js), sorted(writers)
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "nats") as server:
        assert lay_out_for_the_local_run(server.url, Settings(memories_partitions=8)) is None
        assert lay_out_for_the_local_run(server.url, Settings(memories_partitions=4)) is None
        assert asyncio.run(layout_of(server.url)) == (4, sorted(bus.writer_durable(p) for p in range(4)))
        asyncio.run(layout_of(server.url, queue_a_write=True))  # a write of the old count, not decided yet
        refused = lay_out_for_the_local_run(server.url, Settings(memories_partitions=6))
        assert refused is not None and "1 writes are queued" in refused and "once with the count it had" in refused
        assert lay_out_for_the_local_run(server.url, Settings(memories_partitions=4)) is None  # as it was: it starts
        assert asyncio.run(layout_of(server.url))[0] == 4


def test_the_local_run_releases_the_writes_its_last_writer_held(tmp_path: Path) -> None:
    # Handed back as the writer stopped, then NATS stopped with `up`: NATS forgot the hand-back, and the writes came
    # back only after the ack wait (30 s), the next writer holding their partition meanwhile (a drill saw 202s).
    from services.cli_bus import lay_out_for_the_local_run

    settings = Settings(memories_partitions=4)

    async def held_by_a_writer(url: str) -> None:
        nc = await bus_connection.connect(url, name="test-held")
        try:
            js = nc.jetstream()
            for n in range(2):
                await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.2.mem_held", f'{{"n": {n}}}'.encode(), stream=bus.WRITES_STREAM)
            taken = await nc.subscribe(nc.new_inbox())
            pull = {"batch": 2, "expires": 1_000_000_000, "group": bus.WRITERS_GROUP}
            await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.{bus.writer_durable(2)}",
                             json.dumps(pull).encode(), reply=taken.subject)
            for _ in range(2):
                await taken.next_msg(timeout=5)  # delivered, never acknowledged: the writer stopped
        finally:
            await nc.close()

    async def consumer_of(url: str) -> tuple[int, int]:
        nc = await bus_connection.connect(url, name="test-held")
        try:
            info = await nc.jetstream().consumer_info(bus.WRITES_STREAM, bus.writer_durable(2))
            return info.num_ack_pending or 0, info.num_pending or 0
        finally:
            await nc.close()

    with EmbeddedNats(tmp_path / "nats") as server:
        assert lay_out_for_the_local_run(server.url, settings) is None
        asyncio.run(held_by_a_writer(server.url))
        assert asyncio.run(consumer_of(server.url)) == (2, 0)
    with EmbeddedNats(tmp_path / "nats") as server:  # the next `memories up`
        assert lay_out_for_the_local_run(server.url, settings) is None
        assert asyncio.run(consumer_of(server.url)) == (0, 2)  # to be delivered now, not after the ack wait


def _memory_on(partition: int, partitions: int, prefix: str) -> str:
    return next(m for i in range(1000) if bus.partition_of(m := f"mem_{prefix}{i:04d}", partitions) == partition)


async def test_writes_stranded_beyond_a_lowered_count_are_moved_to_their_memorys_partition(tmp_path: Path) -> None:
    # A publisher left on the old count after it was lowered from 8 to 4 (docs/operations.md): its writes land on
    # partitions no writer of the new count takes, and stayed there (each caller was told 202).
    async with connected_bus(tmp_path, "test-reroute") as nc:
        js = nc.jetstream()
        await bus.ensure_layout(js, Settings(memories_partitions=8), bus.Role.WRITER)
        await bus.ensure_layout(js, Settings(memories_partitions=4), bus.Role.ADMIN)
        kept, orphaned, consumed = _memory_on(6, 8, "k"), _memory_on(7, 8, "o"), _memory_on(5, 8, "c")
        for memory_id, body in ((kept, b"first"), (kept, b"second"), (consumed, b"taken")):
            await js.publish(bus.write_subject(memory_id, 8), body, stream=bus.WRITES_STREAM)
        assert (await bus_admin.prune_consumers(js, Settings(memories_partitions=4)))[1] == ["writer-p5", "writer-p6"]
        await js.publish(bus.write_subject(orphaned, 8), b"orphan", stream=bus.WRITES_STREAM)  # no consumer left
        # A writer of the old count still consumes partition 5: it has its write in hand, and decides it.
        old_writer = await nc.subscribe(nc.new_inbox())
        pull = {"batch": 1, "expires": 30_000_000_000, "group": bus.WRITERS_GROUP}
        await nc.publish(f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.writer-p5", json.dumps(pull).encode(),
                         reply=old_writer.subject)
        assert (await old_writer.next_msg(timeout=5)).data == b"taken"

        # `bus status` says them, the orphan too, which no consumer shows (it showed only "4 writes queued").
        assert (await bus_admin.bus_status(js, Settings(memories_partitions=4))).stranded_writes == 4
        with pytest.raises(bus.PartitionCountMismatch, match="reroute with MEMORIES_PARTITIONS=4"):
            await bus_admin.reroute_stranded_writes(js, Settings(memories_partitions=8))
        moved, left = await bus_admin.reroute_stranded_writes(js, Settings(memories_partitions=4))
        assert (moved, left) == (3, ["writer-p5"])

        async def bodies(subject: str) -> list[bytes]:
            found, sequence = [], 1
            while True:
                try:
                    message = await js.get_msg(bus.WRITES_STREAM, seq=sequence, subject=subject, next=True)
                except nats.js.errors.NotFoundError:
                    return found
                found.append(message.data)
                sequence = (message.seq or 0) + 1

        assert await bodies(bus.write_subject(kept, 4)) == [b"first", b"second"]  # in their order
        assert await bodies(bus.write_subject(orphaned, 4)) == [b"orphan"]
        assert await bodies(bus.write_subject(kept, 8)) == await bodies(bus.write_subject(orphaned, 8)) == []
        assert await bodies(bus.write_subject(consumed, 8)) == [b"taken"]  # its writer's to decide
        # Nothing stranded is left: a second run moves nothing.
        assert await bus_admin.reroute_stranded_writes(js, Settings(memories_partitions=4)) == (0, ["writer-p5"])


async def test_a_publish_jetstream_answers_with_an_error_is_known_not_stored(tmp_path: Path) -> None:
    # Every failure counted as "sent, may still be applied" (a 503 that said so, with a write id to look up), even
    # when JetStream had answered that it stored nothing.
    async with connected_bus(tmp_path, "test-refused") as nc:
        await bus.ensure_layout(nc.jetstream(), Settings(memories_partitions=2), bus.Role.WRITER)
        with pytest.raises(bus.BusUnavailable) as refused:  # the subject is not the named stream's
            await bus.publish_or_refuse(nc, bus.write_subject("mem_x", 2), b"{}", stream=bus.EVENTS_STREAM,
                                        msg_id="w1")
        assert not refused.value.sent
        with pytest.raises(bus.BusUnavailable) as unheard:  # no stream takes the subject at all
            await bus.publish_or_refuse(nc, "nowhere.at.all", b"{}", stream=bus.WRITES_STREAM, msg_id="w2")
        assert not unheard.value.sent


async def test_a_services_consumers_wait_out_an_outage_as_long_as_its_own_connection(writers: list[Any]) -> None:
    """FastStream's broker has a connection of its own; by its defaults it gave up after 60 reconnects (~2 min), and
    the consumers on it stopped for good while the service went on looking alive."""
    for writer in writers:
        consumers, own = writer.broker._connection.options, writer.nc.options
        assert consumers["max_reconnect_attempts"] == own["max_reconnect_attempts"] == -1
        for option in ("reconnect_time_wait", "ping_interval", "max_outstanding_pings"):
            assert consumers[option] == own[option], option


async def test_a_change_event_the_bus_does_not_acknowledge_while_away_is_one_warning_not_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The client keeps it buffered across the reconnect: "could not publish" with a trace, once per edit, was wrong.
    from shared.events import EntryChangeKind, MemoryEntryChanged

    class Away:
        async def publish(self, *_args: Any, **_options: Any) -> None:
            raise nats.errors.TimeoutError

    class Broken:
        async def publish(self, *_args: Any, **_options: Any) -> None:
            raise ValueError("a bug")

    change = MemoryEntryChanged(event_id="evt_c", project_id="proj_c", memory_id="mem_c", entry_id="ent_c",
                                kind=EntryChangeKind.UPDATED)
    with caplog.at_level(logging.WARNING, logger="shared.bus"):
        await bus.announce_entry_change(Away(), change, msg_id="m1")  # type: ignore[arg-type]
        assert [(r.levelno, r.exc_info) for r in caplog.records] == [(logging.WARNING, None)]
        caplog.clear()
        await bus.announce_entry_change(Broken(), change, msg_id="m2")  # type: ignore[arg-type]
        assert [r.levelno for r in caplog.records] == [logging.ERROR] and caplog.records[0].exc_info
