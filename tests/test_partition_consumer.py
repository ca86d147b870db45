"""The writer's own pull loop for one partition (services.writer.partitions), on the real JetStream: what
is queued arrives as one batch in publish order, a batch slower than the ack wait is not redelivered
meanwhile, stopping finishes the batch in hand, and the next batch is prepared while one is finished,
the batches still finished in order."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.writer import partitions
from services.writer.partitions import PartitionConsumer
from shared import bus
from shared.settings import Settings


async def _own_durable(js: Any, partition: int, max_ack_pending: int, ack_wait: float = 30.0) -> None:
    await js.add_consumer(
        bus.WRITES_STREAM,
        ConsumerConfig(
            durable_name=bus.writer_durable(partition),
            filter_subject=bus.partition_filter(partition),
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_ack_pending=max_ack_pending,
        ),
    )


async def test_a_partition_arrives_in_order_in_batches_kept_in_progress(settings: Settings, writers: list[Any]) -> None:
    partition = settings.memories_partitions + 7  # a partition no running writer consumes
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await _own_durable(js, partition, max_ack_pending=8, ack_wait=1.0)
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
        rival = await js.pull_subscribe_bind(durable=bus.writer_durable(partition), stream=bus.WRITES_STREAM)
        try:
            stolen.extend(await rival.fetch(batch=5, timeout=0.5))
        except TimeoutError:
            pass
        await rival.unsubscribe()
        await asyncio.sleep(0.5)
        for message in messages:
            await message.ack()
        finished.set()

    try:
        for i in range(5):
            await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_p{i}", str(i).encode(), stream=bus.WRITES_STREAM)
        consumer = PartitionConsumer(js, partition, prepare, slow_finish, batch=8, ack_wait_s=1.0)
        consumer.start()
        while not batches:
            await asyncio.sleep(0.01)
        await consumer.stop(timeout=10)  # called mid-batch: returns once the batch is finished
        assert finished.is_set()
        assert batches == [["0", "1", "2", "3", "4"]]
        assert deliveries == [1, 1, 1, 1, 1] and stolen == []
        for _ in range(100):  # acks are asynchronous: the server counts them a moment later
            info = await js.consumer_info(bus.WRITES_STREAM, bus.writer_durable(partition))
            if info.num_ack_pending == 0:
                break
            await asyncio.sleep(0.02)
        assert info.num_ack_pending == 0 and info.num_pending == 0 and info.num_redelivered == 0
    finally:
        await js.delete_consumer(bus.WRITES_STREAM, bus.writer_durable(partition))
        await nc.close()


async def test_the_next_batch_is_prepared_while_one_is_finished_and_finished_after_it(
    settings: Settings, writers: list[Any]
) -> None:
    partition = settings.memories_partitions + 8  # a partition no running writer consumes
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await _own_durable(js, partition, max_ack_pending=bus.WRITE_BATCHES_IN_HAND * 3)
    steps: list[tuple[str, list[str]]] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        steps.append(("prepared", [m.data.decode() for m in messages]))
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        if not any(step == "finished" for step, _ in steps):
            await asyncio.sleep(0.5)  # the first batch decides slowly
        for message in messages:
            await message.ack()
        steps.append(("finished", [m.data.decode() for m in messages]))

    try:
        for i in range(6):
            await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_q{i}", str(i).encode(), stream=bus.WRITES_STREAM)
        consumer = PartitionConsumer(js, partition, prepare, finish, batch=3, ack_wait_s=30.0)
        consumer.start()
        for _ in range(300):
            if len(steps) == 4:
                break
            await asyncio.sleep(0.01)
        await consumer.stop(timeout=10)
        assert steps == [
            ("prepared", ["0", "1", "2"]),
            ("prepared", ["3", "4", "5"]),  # while the first batch is still being finished
            ("finished", ["0", "1", "2"]),
            ("finished", ["3", "4", "5"]),
        ]
    finally:
        await js.delete_consumer(bus.WRITES_STREAM, bus.writer_durable(partition))
        await nc.close()


async def test_stopping_hands_back_at_once_what_the_last_fetch_brings(settings: Settings, writers: list[Any]) -> None:
    partition = settings.memories_partitions + 9  # a partition no running writer consumes
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await _own_durable(js, partition, max_ack_pending=8, ack_wait=60.0)
    handled: list[Msg] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        handled.extend(messages)
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        for message in messages:
            await message.ack()

    try:
        consumer = PartitionConsumer(js, partition, prepare, finish, batch=8, ack_wait_s=60.0)
        consumer.start()
        await asyncio.sleep(0.5)  # idle: its fetch waits on the server for a first message
        stopping = asyncio.create_task(consumer.stop(timeout=10))
        await asyncio.sleep(0.1)
        # A write published as the writer stops (a rolling deploy): it must not wait out the 60 s ack wait.
        await js.publish(f"{bus.WRITE_SUBJECT_ROOT}.{partition}.mem_late", b"late", stream=bus.WRITES_STREAM)
        await asyncio.wait_for(stopping, 10)
        assert handled == []
        successor = await js.pull_subscribe_bind(durable=bus.writer_durable(partition), stream=bus.WRITES_STREAM)
        [message] = await successor.fetch(batch=1, timeout=5)
        assert message.data == b"late" and message.metadata.num_delivered == 2
        await message.ack()
        await successor.unsubscribe()
    finally:
        await js.delete_consumer(bus.WRITES_STREAM, bus.writer_durable(partition))
        await nc.close()


async def test_a_lone_write_after_an_idle_fetch_is_not_held_until_the_next_fetch_deadline(
    settings: Settings, writers: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # After a fetch times out, the server's answer to its expired request may arrive after the next fetch began:
    # nats-py took it for the answer to its new request and fell back to one that waits for a whole batch, so a
    # lone write waited for that fetch's deadline (up to 5 s in production; here a 0.3 s fetch, 5% of writes).
    monkeypatch.setattr(partitions, "FETCH_WAIT_S", 0.3)
    partition = settings.memories_partitions + 10  # a partition no running writer consumes
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await _own_durable(js, partition, max_ack_pending=8)
    published: dict[bytes, float] = {}
    waited: list[float] = []

    async def prepare(messages: Sequence[Msg]) -> Sequence[Msg]:
        return messages

    async def finish(messages: Sequence[Msg]) -> None:
        for message in messages:
            waited.append(time.monotonic() - published[message.data])
            await message.ack()

    gaps = random.Random(7)
    try:
        consumer = PartitionConsumer(js, partition, prepare, finish, batch=8, ack_wait_s=30.0)
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
        assert len(waited) == 60
        assert [round(w, 3) for w in waited if w > 0.15] == []  # a lone write takes milliseconds
    finally:
        await js.delete_consumer(bus.WRITES_STREAM, bus.writer_durable(partition))
        await nc.close()
