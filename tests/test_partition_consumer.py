"""The writer's own pull loop for one partition (services.writer.partitions), on the real JetStream: what
is queued arrives as one batch in publish order, a batch slower than the ack wait is not redelivered
meanwhile, stopping finishes the batch in hand, and the next batch is prepared while one is finished,
the batches still finished in order."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.msg import Msg

from services.writer import partitions
from services.writer.main import Writer
from services.writer.partitions import PartitionConsumer, PinnedPull
from shared import bus
from shared.servers import free_port
from shared.settings import Settings

OwnDurable = Callable[..., Awaitable[tuple[int, Any, Any]]]


@pytest_asyncio.fixture
async def own_durable(settings: Settings) -> AsyncIterator[OwnDurable]:
    """A writer partition's durable beyond the count (no running writer consumes it), with a connection of its own;
    both are gone after the test."""
    made: list[tuple[Any, int]] = []

    async def make(offset: int, *, max_ack_pending: int, ack_wait: float = 30.0) -> tuple[int, Any, Any]:
        partition = settings.memories_partitions + offset
        nc = await nats.connect(settings.nats_url)
        js = nc.jetstream()
        await js.add_consumer(
            bus.WRITES_STREAM, bus.writer_consumer(partition, max_ack_pending=max_ack_pending, ack_wait_s=ack_wait)
        )
        made.append((nc, partition))
        return partition, nc, js

    yield make
    for nc, partition in made:
        await nc.jetstream().delete_consumer(bus.WRITES_STREAM, bus.writer_durable(partition))
        await nc.close()


async def test_a_partition_arrives_in_order_in_batches_kept_in_progress(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    partition, nc, js = await own_durable(7, max_ack_pending=8, ack_wait=1.0)
    rival_nc = await nats.connect(settings.nats_url)
    batches: list[list[str]] = []
    deliveries: list[int] = []
    stolen: list[Msg] = []
    finished = asyncio.Event()

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        return messages

    async def slow_finish(messages: Sequence[Msg]) -> None:
        batches.append([m.data.decode() for m in messages])
        deliveries.extend(m.metadata.num_delivered for m in messages)
        # Longer than the ack wait: only the in-progress signals keep them from a competing replica.
        await asyncio.sleep(1.6)
        rival = PinnedPull(rival_nc, partition)  # another replica
        stolen.extend(await rival.fetch(batch=5, wait_s=0.5))
        await rival.close()
        await asyncio.sleep(0.5)
        for message in messages:
            await message.ack()
        finished.set()

    try:
        for i in range(5):
            await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_p{i}", str(i).encode(), stream=bus.WRITES_STREAM)
        consumer = PartitionConsumer(nc, partition, prepare, slow_finish, batch=8, ack_wait_s=1.0)
        consumer.start()
        while not batches:
            await asyncio.sleep(0.01)
        await consumer.stop(timeout=10)  # called mid-batch: returns once the batch is finished
        await consumer.release()
        assert finished.is_set()
        assert batches == [["0", "1", "2", "3", "4"]]
        assert deliveries == [1, 1, 1, 1, 1] and stolen == []
        for _ in range(100):  # acks are asynchronous: the server counts them a moment later
            info = await js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(partition))
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.02)
        assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
        # Each delivered once: a write the ack wait had handed back meanwhile (to this replica's next pull, the
        # partition being pinned here) would be counted here even though it was handed back again at the stop.
        assert info.delivered.consumer_seq == 5
    finally:
        await rival_nc.close()


async def test_the_next_batch_is_prepared_while_one_is_finished_and_finished_after_it(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    partition, nc, js = await own_durable(8, max_ack_pending=bus.WRITE_BATCHES_IN_HAND * 3)
    steps: list[tuple[str, list[str]]] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        steps.append(("prepared", [m.data.decode() for m in messages]))
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        if messages[0].data == b"0":
            await asyncio.sleep(0.5)  # the first batch after the warm-up decides slowly
        for message in messages:
            await message.ack()
        steps.append(("finished", [m.data.decode() for m in messages]))

    consumer = PartitionConsumer(nc, partition, prepare, finish, batch=3, ack_wait_s=30.0)
    consumer.start()
    # A first write pins the partition to this consumer: until then a fetch takes two batches at once.
    await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_q", b"warm-up", stream=bus.WRITES_STREAM)
    while len(steps) < 2:
        await asyncio.sleep(0.01)
    del steps[:2]
    for i in range(6):
        await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_q{i}", str(i).encode(), stream=bus.WRITES_STREAM)
    for _ in range(300):
        if sum(len(batch) for step, batch in steps if step == "finished") == 6:
            break
        await asyncio.sleep(0.01)
    await consumer.stop(timeout=10)
    await consumer.release()
    prepared = [batch for step, batch in steps if step == "prepared"]
    finished = [batch for step, batch in steps if step == "finished"]
    # The second batch was prepared while the first was still being finished; the batches finished in order.
    assert [step for step, _ in steps[:3]] == ["prepared", "prepared", "finished"]
    assert finished == prepared and [data for batch in finished for data in batch] == [str(i) for i in range(6)]


async def test_stopping_hands_back_at_once_what_the_last_fetch_brings(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    partition, nc, js = await own_durable(9, max_ack_pending=8, ack_wait=60.0)
    handled: list[Msg] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        handled.extend(messages)
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        for message in messages:
            await message.ack()

    consumer = PartitionConsumer(nc, partition, prepare, finish, batch=8, ack_wait_s=60.0)
    consumer.start()
    await asyncio.sleep(0.5)  # idle: its fetch waits on the server for a first message
    stopping = asyncio.create_task(consumer.stop(timeout=10))
    await asyncio.sleep(0.1)
    # A write published as the writer stops (a rolling deploy): it must not wait out the 60 s ack wait.
    await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_late", b"late", stream=bus.WRITES_STREAM)
    await asyncio.wait_for(stopping, 10)
    assert handled == []
    await consumer.release()  # else the next replica would wait out the pin's timeout (65 s here)
    successor = PinnedPull(nc, partition)
    [message] = await successor.fetch(batch=1, wait_s=5)
    assert message.data == b"late" and message.metadata.num_delivered == 2
    await message.ack()
    await successor.close()


async def test_a_lone_write_after_an_idle_fetch_is_not_held_until_the_next_fetch_deadline(
    settings: Settings, writers: list[Any], own_durable: OwnDurable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pull returns as soon as a first write comes, whatever point of a pull it comes at, not when the batch is full
    # or the pull expires. (With nats-py's fetch, a timed-out request's late 408 was taken for the next one's answer
    # and a lone write waited for that fetch's deadline: 5% of writes here, with a 0.3 s fetch. Each request has
    # its own reply subject now.)
    monkeypatch.setattr(partitions, "FETCH_WAIT_S", 0.3)
    partition, nc, js = await own_durable(10, max_ack_pending=8)
    published: dict[bytes, float] = {}
    waited: list[float] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        for message in messages:
            waited.append(time.monotonic() - published[message.data])
            await message.ack()

    gaps = random.Random(7)
    consumer = PartitionConsumer(nc, partition, prepare, finish, batch=8, ack_wait_s=30.0)
    consumer.start()
    for i in range(60):
        await asyncio.sleep(gaps.uniform(0.05, 0.45))  # across fetch timeouts, at every point of one
        published[str(i).encode()] = time.monotonic()
        await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_idle", str(i).encode(), stream=bus.WRITES_STREAM)
    for _ in range(100):
        if len(waited) == 60:
            break
        await asyncio.sleep(0.02)
    await consumer.stop(timeout=10)
    await consumer.release()
    assert len(waited) == 60
    assert [round(w, 3) for w in waited if w > 0.15] == []  # a lone write takes milliseconds


class Replica:
    """A writer replica of one partition, on its own connection: records what it decides, in order."""

    def __init__(
        self, name: str, decided: list[tuple[str, str]], *, hang: asyncio.Event | None = None, hang_in: str = "finish",
        gate: asyncio.Event | None = None,
    ) -> None:
        self.name = name
        self._decided = decided
        self._hang = hang  # a stage waits for it, then nothing is acknowledged (a replica dying with its batches)
        self._hang_in = hang_in
        self._gate = gate  # finish waits for it, then decides (a replica slow to decide)
        self.nc: Any = None
        self.consumer: PartitionConsumer[Sequence[Msg]] | None = None
        self.failures: list[str] = []  # what `on_failure` was told

    async def start(self, settings: Settings, partition: int, *, batch: int, ack_wait_s: float) -> None:
        self.nc = await nats.connect(settings.nats_url)
        self.consumer = PartitionConsumer(
            self.nc, partition, self._prepare, self._finish, batch=batch, ack_wait_s=ack_wait_s,
            on_failure=self.failures.append,
        )
        self.consumer.start()

    async def _prepare(self, messages: Sequence[Msg]) -> Sequence[Msg]:
        if self._hang is not None and self._hang_in == "prepare":
            await self._hang.wait()
        return messages

    async def _finish(self, messages: Sequence[Msg]) -> None:
        if self._hang is not None:
            await self._hang.wait()
            return
        if self._gate is not None:
            await self._gate.wait()
        for message in messages:
            self._decided.append((self.name, message.data.decode()))
            await message.ack()

    async def stop(self) -> None:
        assert self.consumer is not None
        await self.consumer.stop(timeout=10)
        await self.consumer.release()
        await self.nc.close()


async def _until(condition: Callable[[], bool], timeout: float) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def test_a_partition_is_one_replicas_at_a_time_and_passes_to_the_next_at_once_when_it_stops(
    settings: Settings, writers: list[Any], own_durable: OwnDurable, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The waiting replica's pull requests must not hold up the other's: JetStream refuses a `no_wait` request
    # while another waits, and a fetch built on one waited for the waiting replica's request to expire.
    monkeypatch.setattr(partitions, "FETCH_WAIT_S", 4.0)
    partition, _nc, js = await own_durable(11, max_ack_pending=8)
    decided: list[tuple[str, str]] = []
    first, second = Replica("first", decided), Replica("second", decided)
    subject = f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_pinned"
    try:
        await first.start(settings, partition, batch=4, ack_wait_s=30.0)
        await js.publish(subject, b"0", stream=bus.WRITES_STREAM)
        await _until(lambda: len(decided) == 1, 5)  # the partition is pinned to the first replica
        await second.start(settings, partition, batch=4, ack_wait_s=30.0)
        for i in range(1, 30):  # queued in bursts and one by one: without the pin, either replica takes some
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
            if i % 7 == 0:
                await asyncio.sleep(0.05)
        await _until(lambda: len(decided) == 30, 2.5)  # a few milliseconds each; held, up to FETCH_WAIT_S
        assert decided == [("first", str(i)) for i in range(30)]
        # A rolling restart: the stopping replica gives the partition up, and the other one need not wait out the
        # pin's timeout (35 s here).
        await first.stop()
        started = time.monotonic()
        for i in range(30, 35):
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
        await _until(lambda: len(decided) == 35, 10)
        assert decided[30:] == [("second", str(i)) for i in range(30, 35)]
        assert time.monotonic() - started < 5
    finally:
        await second.stop()


@pytest.mark.parametrize(
    ("hang_in", "held_s"),
    [
        ("finish", 0.0),  # crashes while deciding, its next pull open
        # Crashes after preparing longer than the pin's timeout, pulling nothing meanwhile: its pin must not have
        # lapsed while it held the writes (kept in progress), or the other replica decides later writes first.
        ("prepare", 7.0),
    ],
)
async def test_a_crashed_replicas_writes_are_decided_by_the_next_before_writes_published_after_them(
    settings: Settings, writers: list[Any], own_durable: OwnDurable, hang_in: str, held_s: float
) -> None:
    partition, _nc, js = await own_durable(12, max_ack_pending=8, ack_wait=1.0)  # so pinned for 6 s without a pull
    decided: list[tuple[str, str]] = []
    dying = asyncio.Event()
    crashing, survivor = Replica("crashing", decided, hang=dying, hang_in=hang_in), Replica("survivor", decided)
    subject = f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_crash"
    try:
        for i in range(5):
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
        await crashing.start(settings, partition, batch=4, ack_wait_s=1.0)
        for _ in range(250):
            if (await js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(partition))).num_ack_pending == 5:
                break
            await asyncio.sleep(0.02)
        await survivor.start(settings, partition, batch=4, ack_wait_s=1.0)
        await asyncio.sleep(held_s)
        await crashing.nc.close()  # dies holding a batch, its messages unacknowledged, within max_ack_pending
        dying.set()
        for i in range(5, 8):  # published while its writes wait to be delivered again
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
        await _until(lambda: len(decided) == 8, 15)
        assert decided == [("survivor", str(i)) for i in range(8)]
    finally:
        assert crashing.consumer is not None
        await crashing.consumer.stop(timeout=1)
        await survivor.stop()


async def test_a_replica_whose_pull_loop_died_does_not_keep_its_partition(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    # The replica stays alive (its keep-alive would hold the pin for ever), but it consumes nothing any more: the pin
    # must lapse so that another replica carries on.
    partition, _nc, js = await own_durable(13, max_ack_pending=8, ack_wait=1.0)  # pinned for 6 s without a pull
    decided: list[tuple[str, str]] = []
    broken, survivor = Replica("broken", decided), Replica("survivor", decided)
    subject = f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_broken"
    try:
        await broken.start(settings, partition, batch=4, ack_wait_s=1.0)
        await js.publish(subject, b"0", stream=bus.WRITES_STREAM)
        await _until(lambda: len(decided) == 1, 5)
        assert broken.consumer is not None

        async def bug(batch: int, wait_s: float) -> list[Msg]:
            raise RuntimeError("a bug in the pull loop")

        broken.consumer._pull.fetch = bug  # type: ignore[method-assign]
        loop = broken.consumer._loop
        await _until(lambda: loop is not None and loop.done(), 5)  # once the pull under way ends
        await survivor.start(settings, partition, batch=4, ack_wait_s=1.0)
        await js.publish(subject, b"1", stream=bus.WRITES_STREAM)
        await _until(lambda: len(decided) == 2, 15)
        assert decided == [("broken", "0"), ("survivor", "1")]
        assert broken.failures == [f"consuming partition {partition} ended: RuntimeError('a bug in the pull loop')"]
        assert survivor.failures == []
    finally:
        await survivor.stop()
        await broken.stop()


@pytest.mark.parametrize("counting_fails_once", [False, True], ids=["", "counting-fails-once"])
async def test_a_replica_given_a_partition_another_still_holds_writes_of_decides_after_them(
    settings: Settings, writers: list[Any], own_durable: OwnDurable, counting_fails_once: bool
) -> None:
    # The pin moves while its holder is deciding (on a cluster, when the consumer's leader changes; here, as an
    # operator's unpin does it): the new holder must not decide later writes before the ones the former still has.
    partition, nc, js = await own_durable(15 if counting_fails_once else 14, max_ack_pending=8)
    decided: list[tuple[str, str]] = []
    deciding = asyncio.Event()
    former, successor = Replica("former", decided, gate=deciding), Replica("successor", decided)
    subject = f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_moved"
    try:
        await former.start(settings, partition, batch=4, ack_wait_s=30.0)
        for i in range(3):
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
        for _ in range(250):
            if (await js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(partition))).num_ack_pending == 3:
                break
            await asyncio.sleep(0.02)
        await successor.start(settings, partition, batch=4, ack_wait_s=30.0)
        if counting_fails_once:
            # The consumer's state unanswered once, as while its leader changes: what the successor fetched must
            # stay in its hand (dropped, it came back after the 30 s ack wait).
            assert successor.consumer is not None
            pull = successor.consumer._pull
            count, failures = pull.unacknowledged, [nats.errors.TimeoutError()]

            async def flaky_count() -> int:
                if failures:
                    raise failures.pop()
                return await count()

            pull.unacknowledged = flaky_count  # type: ignore[method-assign]
        unpin = f"$JS.API.CONSUMER.UNPIN.{bus.WRITES_STREAM}.{bus.writer_durable(partition)}"
        await nc.request(unpin, json.dumps({"group": bus.WRITERS_GROUP}).encode(), timeout=2)
        await js.publish(subject, b"3", stream=bus.WRITES_STREAM)  # fetched by the successor, now pinned
        await asyncio.sleep(1.0)
        deciding.set()  # the former holder decides what it holds
        await _until(lambda: len(decided) == 4, 10)
        assert decided == [("former", "0"), ("former", "1"), ("former", "2"), ("successor", "3")]
        assert not counting_fails_once or not failures
    finally:
        deciding.set()
        await successor.stop()
        await former.stop()


async def _until_ack_pending(js: Any, durable: str, count: int) -> None:
    for _ in range(250):
        if (pending := (await js.consumer_info(bus.WRITES_STREAM, durable)).num_ack_pending) == count:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{pending} writes in flight, not {count}")


async def test_a_replica_stopped_while_it_waits_for_the_former_holder_hands_back_what_it_fetched(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    # Stopped past its budget while waiting for the former holder's writes, it kept the write it had fetched neither
    # in hand nor handed back: that write waited out the ack wait (30 s here), ack-pending on a replica gone.
    partition, nc, js = await own_durable(16, max_ack_pending=8)
    decided: list[tuple[str, str]] = []
    deciding = asyncio.Event()
    former, successor = Replica("former", decided, gate=deciding), Replica("successor", decided)
    subject = f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_handed"
    durable = bus.writer_durable(partition)
    try:
        await former.start(settings, partition, batch=4, ack_wait_s=30.0)
        for i in range(3):
            await js.publish(subject, str(i).encode(), stream=bus.WRITES_STREAM)
        await _until_ack_pending(js, durable, 3)  # the former holder decides them, slowly
        await successor.start(settings, partition, batch=4, ack_wait_s=30.0)
        unpin = f"$JS.API.CONSUMER.UNPIN.{bus.WRITES_STREAM}.{durable}"
        await nc.request(unpin, json.dumps({"group": bus.WRITERS_GROUP}).encode(), timeout=2)
        await js.publish(subject, b"3", stream=bus.WRITES_STREAM)  # fetched by the successor, which waits
        await _until_ack_pending(js, durable, 4)
        await asyncio.sleep(0.2)  # inside its wait for the former holder's writes
        assert successor.consumer is not None
        await successor.consumer.stop(timeout=0.05)
        await successor.consumer.release()
        deciding.set()
        await _until(lambda: len(decided) == 4, 10)
        assert decided == [("former", "0"), ("former", "1"), ("former", "2"), ("former", "3")]
    finally:
        deciding.set()
        await successor.nc.close()
        await former.stop()


async def test_a_pin_that_could_not_be_given_up_is_said(
    settings: Settings, writers: list[Any], own_durable: OwnDurable, caplog: pytest.LogCaptureFixture
) -> None:
    # Suppressed silently, it left the partition pinned to a replica gone (its handed-back writes ack-pending until
    # the pin lapsed), with nothing in the log to tell why.
    partition, _nc, js = await own_durable(17, max_ack_pending=8)
    decided: list[tuple[str, str]] = []
    replica = Replica("only", decided)
    await replica.start(settings, partition, batch=4, ack_wait_s=30.0)
    await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_pin", b"0", stream=bus.WRITES_STREAM)
    await _until(lambda: len(decided) == 1, 5)  # pinned here
    assert replica.consumer is not None

    async def unanswered() -> dict[str, Any]:
        raise nats.errors.TimeoutError

    replica.consumer._pull._consumer_info = unanswered  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="memories.writer"):
        await replica.stop()
    assert any("could not give up its pin" in record.getMessage() for record in caplog.records)


async def test_a_writer_whose_partition_loop_died_stops_and_exits_with_status_1(
    settings: Settings, writers: list[Any], own_durable: OwnDurable
) -> None:
    # Left running, it looked ready (/readyz) while the partition went unconsumed for good if no other replica ran.
    partition, _nc, _js = await own_durable(16, max_ack_pending=8)
    writer = Writer(settings.model_copy(update={"memories_metrics_port": free_port()}), partitions=[partition])
    running = asyncio.create_task(writer.run_until_signalled())
    await _until(lambda: bool(writer._partition_consumers), 30)
    assert writer.is_ready()

    async def bug(batch: int, wait_s: float) -> list[Msg]:
        raise RuntimeError("a bug in the pull loop")

    writer._partition_consumers[0]._pull.fetch = bug  # type: ignore[method-assign]
    assert await asyncio.wait_for(running, 30) == 1
    assert not writer.is_ready()
