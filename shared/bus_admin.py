"""The bus as an operator sees and mends it: each consumer's state (`memories bus status`), the consumers a lowered
partition count left (`bus prune`), the writes stranded beyond it (`bus reroute`), and the writes a stopped local
run held (`memories up`). The layout itself, and what the services do on the bus, are shared.bus."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from shared.bus import (
    WRITE_SUBJECT_ROOT,
    WRITES_STREAM,
    PartitionCountMismatch,
    Role,
    ensure_layout,
    layout,
    listing_order,
    recorded_partitions,
    write_subject,
    writer_durable,
    writer_partition,
)
from shared.settings import Settings


@dataclass(frozen=True, slots=True)
class ConsumerState:
    stream: str
    consumer: str
    pending: int  # not yet delivered
    in_flight: int  # delivered, not acknowledged
    redelivered: int
    pulling: int  # pull requests waiting: a writer still consumes from it
    role: Literal["layout", "stale", "other"]
    """stale: a writer partition beyond the count; other: not the service's (an integrator's, say)."""


@dataclass(frozen=True, slots=True)
class BusStatus:
    partitions: int | None  # what MEMORY_WRITES is laid out for; None before `memories bus init`
    queued_writes: int  # messages in MEMORY_WRITES
    consumers: list[ConsumerState]
    stranded: list[StrandedSubject] = field(default_factory=list)
    """The subjects with writes queued on partitions beyond the count (a publisher left on the old count), with or
    without a consumer left: for `memories bus reroute`."""

    @property
    def stranded_writes(self) -> int:
        return sum(subject.writes for subject in self.stranded)


@dataclass(frozen=True, slots=True)
class StrandedSubject:
    subject: str
    partition: int
    memory_id: str
    writes: int


async def bus_status(js: JetStreamContext, settings: Settings) -> BusStatus:
    """Every durable consumer of the layout's streams as JetStream reports it now (`memories bus status`)."""
    partitions = await recorded_partitions(js)
    plan = layout(settings)
    planned = {(consumer.stream, consumer.durable) for consumer in plan.consumers}
    states, queued, stranded = [], 0, []
    for stream in plan.streams:
        name = stream.name or ""
        try:
            infos = await js.consumers_info(name)
            if name == WRITES_STREAM:
                queued, subjects = await _queued_writes(js)
                stranded = _beyond(subjects, partitions)
        except NotFoundError:  # the layout is not applied yet
            continue
        for info in sorted(infos, key=lambda i: listing_order(i.name)):
            partition = writer_partition(info.name) if name == WRITES_STREAM else None
            stale = partition is not None and partitions is not None and partition >= partitions
            role = "stale" if stale else "layout" if (name, info.name) in planned else "other"
            counts = (
                info.num_pending or 0, info.num_ack_pending or 0, info.num_redelivered or 0, info.num_waiting or 0
            )
            states.append(ConsumerState(name, info.name, *counts, role=role))
    return BusStatus(partitions, queued, states, stranded)


async def _queued_writes(js: JetStreamContext) -> tuple[int, dict[str, int]]:
    """The writes queued in MEMORY_WRITES, and how many on each subject (a memory's, on its partition)."""
    state = (await js.stream_info(WRITES_STREAM, subjects_filter=f"{WRITE_SUBJECT_ROOT}.>")).state
    return state.messages, state.subjects or {}


def _beyond(subjects: dict[str, int], partitions: int | None) -> list[StrandedSubject]:
    """The subjects on a partition at or beyond the count."""
    found = []
    for subject, count in subjects.items():
        partition, _, memory_id = subject.removeprefix(f"{WRITE_SUBJECT_ROOT}.").partition(".")
        if partitions is not None and partition.isdigit() and int(partition) >= partitions:
            found.append(StrandedSubject(subject, int(partition), memory_id, count))
    return found


async def prune_consumers(js: JetStreamContext, settings: Settings) -> tuple[list[str], list[str]]:
    """Delete the writer partition consumers beyond the count MEMORY_WRITES is laid out for (`writer-p<N>`… after
    the count was lowered), unless a message still waits on one (it would be lost with it) or a writer of the old
    count still pulls from it (a write it takes after its consumer is gone is stuck): (deleted, kept because busy). Nothing else: another durable on these streams (an integrator's, on the change feed) is not ours.
    Raises PartitionCountMismatch unless MEMORIES_PARTITIONS is the recorded count."""
    status = await bus_status(js, settings)
    _require_the_recorded_count(status, settings, "prune")
    deleted, busy = [], []
    for state in status.consumers:
        if state.role != "stale":
            continue
        if state.pending or state.in_flight or state.pulling:
            busy.append(state.consumer)
        else:
            await js.delete_consumer(state.stream, state.consumer)
            deleted.append(state.consumer)
    return deleted, busy


def _require_the_recorded_count(status: BusStatus, settings: Settings, verb: str) -> int:
    """The count the bus is laid out for, when MEMORIES_PARTITIONS is it; else PartitionCountMismatch (a shell's
    default, a typo: what is beyond the count would be judged by another one)."""
    if status.partitions is None:
        raise PartitionCountMismatch(f"the bus is not laid out yet: nothing to {verb} (`memories bus init` lays it out)")
    if status.partitions != settings.memories_partitions:
        raise PartitionCountMismatch(
            f"the bus is laid out for {status.partitions} partitions, MEMORIES_PARTITIONS is "
            f"{settings.memories_partitions} here: nothing done ({verb} with MEMORIES_PARTITIONS={status.partitions};"
            " to change the count, follow docs/operations.md)"
        )
    return status.partitions


REROUTED_MSG_ID_PREFIX = "rerouted"


async def reroute_stranded_writes(js: JetStreamContext, settings: Settings) -> tuple[int, list[str]]:
    """Move the writes queued on partitions beyond the count (published after the count was lowered, by a
    publisher still configured for the old one: no writer takes them) to their memory's partition under the count,
    where each is decided after that memory's writes queued there already: (writes moved, stale consumers left
    alone because a writer of the old count still consumes them: it decides their writes).
    Raises PartitionCountMismatch unless MEMORIES_PARTITIONS is the recorded count."""
    status = await bus_status(js, settings)
    partitions = _require_the_recorded_count(status, settings, "reroute")
    consumed = {
        state.consumer for state in status.consumers if state.role == "stale" and (state.in_flight or state.pulling)
    }
    moved = 0
    for queued in status.stranded:
        if writer_durable(queued.partition) in consumed:
            continue
        sequence = 1
        while True:
            try:
                stranded = await js.get_msg(WRITES_STREAM, seq=sequence, subject=queued.subject, next=True)
            except NotFoundError:
                break
            assert stranded.seq is not None
            # Its own message id: moved twice (a crash before the delete, then a second run), the second is a
            # duplicate the stream drops within its window; past the window the writer's record of the write is.
            await js.publish(
                write_subject(queued.memory_id, partitions),
                stranded.data or b"",
                stream=WRITES_STREAM,
                headers={"Nats-Msg-Id": f"{REROUTED_MSG_ID_PREFIX}.{stranded.seq}"},
            )
            await js.delete_msg(WRITES_STREAM, stranded.seq)
            moved += 1
            sequence = stranded.seq + 1
    return moved, sorted(consumed, key=listing_order)


async def release_held_writes(js: JetStreamContext, settings: Settings) -> int:
    """For a start no writer runs at (`memories up`, before its services): the writes a stopped run's writer held
    (handed back as it stopped, or in flight when it died) would come back only after the ack wait, since NATS
    forgets a hand-back when it restarts, and the first writer would hold their partitions that long, waiting for
    them. A partition's consumer made anew hands them out at once, in order: MEMORY_WRITES keeps a write until it
    is acknowledged. How many writes it released."""
    released = 0
    for info in await js.consumers_info(WRITES_STREAM):
        if writer_partition(info.name) is not None and info.num_ack_pending:
            await js.delete_consumer(WRITES_STREAM, info.name)
            released += info.num_ack_pending
    if released:
        await ensure_layout(js, settings, Role.ADMIN)  # the consumers deleted, made anew
    return released
