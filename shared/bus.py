"""The JetStream layout (streams, subjects, durable consumers) as code, and the write publisher.

`ensure_layout` is what `memories bus init` applies; every service also applies it at start, so a fresh
deployment needs no manual step. Settings of an existing consumer are updated in place, because a durable
consumer otherwise keeps the settings it was created with.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import re
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from shared.events import DeadLetter, MemoryEntryChanged, storable
from shared.settings import ConfiguredUnlike, Settings

log = logging.getLogger(__name__)

WRITES_STREAM = "MEMORY_WRITES"
EVENTS_STREAM = "MEMORY_EVENTS"
DEAD_LETTER_STREAM = "DEAD_LETTERS"
GENERATIONS_STREAM = "GENERATIONS"
STREAMS = (WRITES_STREAM, EVENTS_STREAM, GENERATIONS_STREAM, DEAD_LETTER_STREAM)
GENERATION_COMPLETED_ROOT = "generations.completed"
GENERATION_DELETED_ROOT = "generations.deleted"
EXTRACTION_COMPLETED_ROOT = "generations.extraction"
CONVERSATION_DELETED_ROOT = "conversations.deleted"
EXTRACTOR_DURABLE = "extractor"
WRITER_GENERATION_DELETIONS = "writer-generation-deletions"
WRITER_CONVERSATION_DELETIONS = "writer-conversation-deletions"
WRITE_SUBJECT_ROOT = "memories.write"
EVENT_SUBJECT_ROOT = "memories.events"
DEAD_LETTER_ROOT = "dlq"
API_KEY_REVOKED_SUBJECT = "memories.api-keys.revoked"  # core NATS, in no stream: a broadcast to the API processes
WRITE_BATCHES_IN_HAND = 2
"""A writer holds a partition's batch being decided and the next one being prepared (embedded); the writes it
sets aside to wait on a model take from the same budget."""
WRITERS_GROUP = "writers"
"""The priority group of every writer partition's durable: JetStream serves one replica of it at a time."""
PIN_MARGIN_S = 5.0
"""How much longer than the ack wait a partition stays pinned to a writer that has stopped pulling. A live writer
pulls (or tells the server it is alive) every 2 to 3 s at most (services.writer.partitions), so a crashed one's
pin lapses after what it held is due again."""


def partition_of(memory_id: str, partitions: int) -> int:
    """Stable across processes and restarts (Python's hash() is salted per process)."""
    return zlib.crc32(memory_id.encode()) % partitions


def write_subject(memory_id: str, partitions: int) -> str:
    return f"{WRITE_SUBJECT_ROOT}.{partition_of(memory_id, partitions)}.{memory_id}"


def partition_filter(partition: int) -> str:
    return f"{WRITE_SUBJECT_ROOT}.{partition}.*"


def writer_durable(partition: int) -> str:
    return f"writer-p{partition}"


def event_subject(project_id: str, kind: str) -> str:
    return f"{EVENT_SUBJECT_ROOT}.{project_id}.{kind}"


def generation_completed_subject(project_id: str) -> str:
    return f"{GENERATION_COMPLETED_ROOT}.{project_id}"


def extraction_completed_subject(project_id: str) -> str:
    return f"{EXTRACTION_COMPLETED_ROOT}.{project_id}"


def generation_deleted_subject(project_id: str) -> str:
    return f"{GENERATION_DELETED_ROOT}.{project_id}"


def conversation_deleted_subject(project_id: str) -> str:
    return f"{CONVERSATION_DELETED_ROOT}.{project_id}"


def dead_letter_subject(origin: str) -> str:
    return f"{DEAD_LETTER_ROOT}.{origin}"


class Role(StrEnum):
    """Who lays out the bus: the admin (`memories bus init`, the init Job) or a service, each with a NATS user of
    its own (shared.bus_permissions)."""

    ADMIN = "admin"
    API = "api"
    WRITER = "writer"
    EXTRACTOR = "extractor"


@dataclass(frozen=True)
class OwnedConsumer:
    """A durable consumer and the service that consumes it: that service alone lays it out and pulls from it
    (shared.bus_permissions gives its user the right to, and no other user)."""

    stream: str
    owner: Role
    config: ConsumerConfig

    @property
    def durable(self) -> str:
        return self.config.durable_name or ""

    @property
    def subject(self) -> str:
        return self.config.filter_subject or ""


@dataclass(frozen=True)
class Layout:
    streams: list[StreamConfig]
    consumers: list[OwnedConsumer]

    def consumers_of(self, role: Role) -> list[OwnedConsumer]:
        """What `role` lays out: the consumers it consumes; the admin's, every one."""
        return [consumer for consumer in self.consumers if role in (Role.ADMIN, consumer.owner)]

    def consumer(self, durable: str) -> OwnedConsumer:
        (found,) = (consumer for consumer in self.consumers if consumer.durable == durable)
        return found


def layout(settings: Settings) -> Layout:
    replicas = settings.memories_stream_replicas
    window = settings.memories_duplicate_window_s
    writes = StreamConfig(
        name=WRITES_STREAM,
        subjects=[f"{WRITE_SUBJECT_ROOT}.>"],
        # Each message is for exactly one partition's consumer and is gone once acknowledged.
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        num_replicas=replicas,
        duplicate_window=window,
        metadata={PARTITIONS_METADATA: str(settings.memories_partitions)},
    )
    events = StreamConfig(
        name=EVENTS_STREAM,
        subjects=[f"{EVENT_SUBJECT_ROOT}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=7 * 24 * 3600,
        duplicate_window=window,
    )
    generations = StreamConfig(
        name=GENERATIONS_STREAM,
        subjects=["generations.>", "conversations.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=7 * 24 * 3600,
        duplicate_window=window,
    )
    dead = StreamConfig(
        name=DEAD_LETTER_STREAM,
        subjects=[f"{DEAD_LETTER_ROOT}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=30 * 24 * 3600,
    )
    writers = [
        writer_consumer(
            p,
            max_ack_pending=WRITE_BATCHES_IN_HAND * settings.memories_write_batch,
            ack_wait_s=settings.memories_ack_wait_s,
        )
        for p in range(settings.memories_partitions)
    ]
    def shared_consumer(name: str, subject: str, max_ack_pending: int) -> ConsumerConfig:
        # One durable shared by every replica of a service: queue semantics, each event to one replica.
        return ConsumerConfig(
            durable_name=name,
            name=name,
            filter_subject=subject,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            max_ack_pending=max_ack_pending,
            ack_wait=settings.memories_ack_wait_s,
            max_deliver=-1,  # as for the writers: the handler decides when a message is poison
        )

    return Layout(
        streams=[writes, events, generations, dead],
        consumers=[
            *(OwnedConsumer(WRITES_STREAM, Role.WRITER, writer) for writer in writers),
            OwnedConsumer(
                GENERATIONS_STREAM,
                Role.EXTRACTOR,
                shared_consumer(EXTRACTOR_DURABLE, f"{GENERATION_COMPLETED_ROOT}.*", 256),
            ),
            OwnedConsumer(
                GENERATIONS_STREAM,
                Role.WRITER,
                shared_consumer(WRITER_GENERATION_DELETIONS, f"{GENERATION_DELETED_ROOT}.*", 64),
            ),
            OwnedConsumer(
                GENERATIONS_STREAM,
                Role.WRITER,
                shared_consumer(WRITER_CONVERSATION_DELETIONS, f"{CONVERSATION_DELETED_ROOT}.*", 64),
            ),
        ],
    )


@dataclass
class PinnedConsumerConfig(ConsumerConfig):
    """A consumer configuration with JetStream's priority groups (NATS 2.11 and later), which nats-py does not
    model. Only the pull requests that name the group are served."""

    priority_groups: list[str] | None = None
    priority_policy: str | None = None
    priority_timeout: float | None = None  # seconds

    def as_dict(self) -> dict[str, Any]:
        result = super().as_dict()
        if self.priority_timeout is not None:
            result["priority_timeout"] = self._to_nanoseconds(self.priority_timeout)
        return result


def writer_consumer(partition: int, *, max_ack_pending: int, ack_wait_s: float) -> PinnedConsumerConfig:
    """A partition's durable. Its writes are decided in the order they were published only if one replica consumes
    it at a time, so it is pinned: JetStream serves the pull requests of one writer replica (the first to pull)
    and keeps the others' waiting, until that replica gives the partition up as it stops, or has not pulled for
    PIN_MARGIN_S longer than the ack wait (it crashed). By then what it held is due to be delivered again, so the
    next replica fetches it before anything published later. (A consumer leader change on a cluster clears the
    pin too; the replica it moves to waits for what the former holder still has: services.writer.partitions.)"""
    return PinnedConsumerConfig(
        durable_name=writer_durable(partition),
        name=writer_durable(partition),
        filter_subject=partition_filter(partition),
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.EXPLICIT,
        # A partition's writer holds one batch being decided and the next being prepared, in order, and the writes
        # it has set aside to wait on a model (services.writer.handler): a partition whose budget is all set aside
        # fetches nothing more until some are decided.
        max_ack_pending=max_ack_pending,
        ack_wait=ack_wait_s,
        # Unlimited on the server: an outage (database or bus) must not exhaust a write's deliveries.
        # The handlers count deliveries of real failures and dead-letter after MEMORIES_MAX_DELIVER.
        max_deliver=-1,
        priority_groups=[WRITERS_GROUP],
        priority_policy="pinned_client",
        priority_timeout=ack_wait_s + PIN_MARGIN_S,
    )


PARTITIONS_METADATA = "memories_partitions"
"""MEMORY_WRITES records the partition count it was laid out for (`memories bus init` sets it)."""


class PartitionCountMismatch(ConfiguredUnlike):
    """A service configured for another partition count than the bus: its writes would land on partitions no
    writer consumes, or a memory's writes on two partitions (out of order)."""


async def ensure_layout(js: JetStreamContext, settings: Settings, role: Role, attempts: int = 5) -> None:
    """Apply the layout; retried, because services starting together on a cluster race to apply it and a
    stream's leader may still be in election.

    The admin applies all of it: every stream updated to this version's settings, every consumer, and the partition
    count changed (once MEMORY_WRITES is drained). A service applies the streams and the consumers it consumes; it
    raises PartitionCountMismatch when configured for another partition count than the bus, and updates a stream
    only if it is unlike its version and no NATS user is configured (a service's user may not)."""
    for attempt in range(1, attempts + 1):
        try:
            await _apply_layout(js, settings, role)
            return
        except (TimeoutError, nats.errors.Error) as exc:
            if attempt == attempts:
                raise
            log.warning("applying the JetStream layout failed (%s), retrying", exc)
            await asyncio.sleep(0.5 * attempt)


async def _apply_layout(js: JetStreamContext, settings: Settings, role: Role) -> None:
    await _check_partitions(js, settings, may_change=role is Role.ADMIN)
    plan = layout(settings)
    for stream in plan.streams:
        try:
            existing = await js.stream_info(stream.name or "")
        except NotFoundError:
            await js.add_stream(stream)
            continue
        if role is Role.ADMIN:  # the layout as this version has it, whatever the stream holds
            await js.update_stream(stream)
        elif unlike := _settings_unlike(existing.config, stream):
            if settings.nats_user:
                # A deployed service's user may not update a stream (shared.bus_permissions): the server would drop
                # the request, and the service time out five times before it stopped.
                raise StreamLaidOutUnlike(
                    f"stream {stream.name} is laid out unlike this version ({', '.join(unlike)}): run this "
                    "version's `memories bus init` as the admin user first (docs/operations.md)"
                )
            await js.update_stream(stream)
    for consumer in plan.consumers_of(role):
        await _ensure_consumer(js, consumer.stream, consumer.config)


class StreamLaidOutUnlike(ConfiguredUnlike):
    """A service logged in as its NATS user found a stream unlike its version's layout, which only the admin updates."""


def _settings_unlike(existing: StreamConfig, wanted: StreamConfig) -> list[str]:
    """The settings the layout gives a stream that it does not have. The server fills in the others (a duplicate
    window left at 0, metadata of its own): only what the layout sets apart from nats-py's defaults is compared,
    durations (seconds) to the millisecond (a fraction of a second comes back from the server off by a nanosecond).
    A setting a later layout leaves at its default again is not compared: `bus init` applies that."""
    unlike = []
    for setting in dataclasses.fields(wanted):
        value, current = getattr(wanted, setting.name), getattr(existing, setting.name)
        if value == setting.default:
            continue
        if setting.name == "metadata":
            same = value.items() <= (current or {}).items()
        elif isinstance(value, float) or isinstance(current, float):
            same = current is not None and math.isclose(current, value, abs_tol=1e-3)
        else:
            same = current == value
        if not same:
            unlike.append(setting.name)
    return unlike


async def check_partitions(js: JetStreamContext, settings: Settings) -> None:
    """Raises PartitionCountMismatch unless the bus is laid out for MEMORIES_PARTITIONS (or not laid out yet)."""
    await _check_partitions(js, settings, may_change=False)


async def _check_partitions(js: JetStreamContext, settings: Settings, *, may_change: bool) -> None:
    """A service starts only with the count the bus is laid out for; `memories bus init` changes it only once
    MEMORY_WRITES is drained (a queued write would land on a partition that changed, or on none)."""
    recorded = await recorded_partitions(js)
    if recorded in (None, settings.memories_partitions):
        return
    if not may_change:
        raise PartitionCountMismatch(
            f"MEMORIES_PARTITIONS is {settings.memories_partitions} here, but the bus is laid out for {recorded} "
            "partitions: configure every service alike, or change the count as docs/operations.md says"
        )
    queued = (await js.stream_info(WRITES_STREAM)).state.messages
    if queued:
        raise PartitionCountMismatch(
            f"the partition count cannot change from {recorded} to {settings.memories_partitions} while "
            f"{queued} writes are queued in {WRITES_STREAM}: stop the publishers and let the writers drain it first"
        )
    # An empty queue is a moment, not a drained system: writers still pulling mean their publishers may run too.
    pulled = [info.name for info in await js.consumers_info(WRITES_STREAM) if info.num_waiting]
    if pulled:
        raise PartitionCountMismatch(
            f"the partition count cannot change from {recorded} to {settings.memories_partitions} while writers "
            f"still consume ({', '.join(sorted(pulled, key=listing_order))}): stop the publishers, let the writers "
            "drain, stop them, then apply the count (docs/operations.md)"
        )
    log.warning("partition count changed from %s to %s", recorded, settings.memories_partitions)


_WRITER_DURABLE = re.compile(r"writer-p(\d+)")


async def recorded_partitions(js: JetStreamContext) -> int | None:
    """The partition count MEMORY_WRITES is laid out for: recorded in its metadata by `memories bus init`, or, on a
    bus laid out before that was recorded, one more than its highest writer partition consumer. None when empty."""
    try:
        info = await js.stream_info(WRITES_STREAM)
    except NotFoundError:
        return None
    recorded = (info.config.metadata or {}).get(PARTITIONS_METADATA)
    if recorded is not None:
        return int(recorded)
    partitions = [writer_partition(consumer.name) for consumer in await js.consumers_info(WRITES_STREAM)]
    known = [p for p in partitions if p is not None]
    return max(known) + 1 if known else None


def writer_partition(consumer: str) -> int | None:
    matched = _WRITER_DURABLE.fullmatch(consumer)
    return int(matched.group(1)) if matched else None


def listing_order(consumer: str) -> tuple[int, str]:
    """Writer partitions in their numeric order (writer-p2 before writer-p10), after the other consumers by name."""
    partition = writer_partition(consumer)
    return (-1 if partition is None else partition, consumer)


async def _ensure_consumer(js: JetStreamContext, stream: str, config: ConsumerConfig) -> None:
    try:
        await js.add_consumer(stream, config=config)
    except BadRequestError:
        # Some fields cannot change in place (e.g. the filter): recreate. Unacked messages stay in the stream.
        log.warning("recreating consumer %s on %s with new settings", config.durable_name, stream)
        await js.delete_consumer(stream, config.durable_name or "")
        await js.add_consumer(stream, config=config)


async def dead_letter(js: JetStreamContext, origin: str, subject: str, body: bytes, *, reason: str) -> None:
    """Park a message that cannot be processed, with why, for `memories dlq list|replay`."""
    from shared import metrics  # here, not at the top: shared.metrics imports this module

    log.error("dead-lettering message from %s: %s", subject, reason, extra={"origin": origin})
    # The reason may quote what came in (a lone surrogate, say); the body is bytes decoded, which cannot hold one.
    letter = DeadLetter(origin_subject=subject, reason=storable(reason), body=body.decode("utf-8", "replace"))
    await js.publish(dead_letter_subject(origin), letter.model_dump_json().encode(), stream=DEAD_LETTER_STREAM)
    metrics.observe_dead_letter(origin)


PUBLISH_TIMEOUT_S = 5.0
"""How long JetStream may take to acknowledge a publish before the bus counts as unavailable."""


class BusUnavailable(Exception):
    """JetStream did not take a publish; a retry under the same message id is safe. `sent`: the message went out
    unconfirmed (a hung server may still store it), as opposed to refused before sending."""

    def __init__(self, reason: str, *, sent: bool = False) -> None:
        super().__init__(reason)
        self.sent = sent


async def publish_or_refuse(nc: NatsClient, subject: str, data: bytes, *, stream: str, msg_id: str) -> None:
    """Onto `stream`, acknowledged, or BusUnavailable. Refused at once while the client is not connected rather
    than buffered by it: a buffered publish would reach the stream whenever the connection came back, long after
    its caller was told 503 (and may have given up, or retried under another id)."""
    if not nc.is_connected:
        raise BusUnavailable("not connected to NATS")
    try:
        await nc.jetstream().publish(
            subject, data, stream=stream, timeout=PUBLISH_TIMEOUT_S, headers={"Nats-Msg-Id": msg_id}
        )
    except (nats.js.errors.APIError, nats.js.errors.NoStreamResponseError) as exc:
        # JetStream answered with an error, or no stream took the subject: nothing was stored.
        raise BusUnavailable(getattr(exc, "description", None) or str(exc) or type(exc).__name__) from exc
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise BusUnavailable(str(exc) or type(exc).__name__, sent=True) from exc


_OUTAGE_SQLSTATES = ("08", "53", "57P")
"""PostgreSQL's errors of an outage: the connection's (class 08), the server out of resources (53: too many
connections, disk full, out of memory), the server shutting down or starting (57P01…). Its other "operational"
errors are the statement's own (57014 a statement timeout, 54000 a limit, 40P01 a deadlock): retried as any
failure, then dead-lettered, not waited out for ever with the partition held behind them."""


def is_outage(exc: BaseException) -> bool:
    """The database, the bus or the embedding provider is unreachable for now: retry for as long as it takes, never
    dead-letter or fail a write for it."""
    from sqlalchemy.exc import DBAPIError, OperationalError
    from sqlalchemy.exc import TimeoutError as PoolTimeout

    from shared.embeddings import EmbeddingError

    if isinstance(exc, EmbeddingError):
        return exc.transient

    if isinstance(exc, OperationalError):
        sqlstate = getattr(exc.orig, "sqlstate", None)  # none: the driver's own, as "connection refused"
        if sqlstate is None or sqlstate.startswith(_OUTAGE_SQLSTATES):
            return True
    elif isinstance(exc, PoolTimeout | OSError | TimeoutError | ConnectionError):
        return True
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:  # whatever its SQLSTATE, the connection is gone
        return True
    from nats.errors import Error as NatsError

    return isinstance(exc, NatsError)


@contextlib.asynccontextmanager
async def kept_in_progress(messages: Sequence[Msg], ack_wait_s: float) -> AsyncIterator[None]:
    """While the block runs, its messages not yet acknowledged are kept in progress (every third of the ack
    wait): however long a model or an outage holds them, JetStream hands none of them to another replica."""
    heartbeat = asyncio.create_task(_keep_in_progress(messages, ack_wait_s / 3))
    try:
        yield
    finally:
        heartbeat.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await heartbeat


async def _keep_in_progress(messages: Sequence[Msg], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        failure: Exception | None = None
        for message in messages:
            if not message.is_acked:
                try:
                    await message.in_progress()
                except Exception as exc:  # noqa: BLE001 - the bus is down, mostly: tried again next time; nothing is lost
                    failure = exc
        if failure is not None:
            log.warning("could not keep messages in progress: %s", str(failure) or type(failure).__name__)


RETRY_DELAY_MAX_S = 30.0
"""The longest pause between two attempts: a redelivery's delay, or a wait in place for an outage to end."""


async def hand_back(messages: Sequence[Msg]) -> None:
    """Return messages to their stream at once, in the order they were published (a memory's writes must come back
    in their order); one the bus cannot take now comes back after the ack wait."""
    for message in sorted(messages, key=lambda m: m.metadata.sequence.stream):
        try:
            await message.nak()
        except nats.errors.Error as exc:
            log.warning("could not hand a message back: %s", exc)


def deliveries(message: Msg) -> int:
    """How many times JetStream has delivered `message`, this time included."""
    return message.metadata.num_delivered if message.metadata else 1


def retried(delivered: int, max_deliver: int, failure: BaseException | None = None) -> bool:
    """The one retry policy of every consumer: an outage is retried for as long as it lasts, any other failure
    until its message's MEMORIES_MAX_DELIVER-th delivery, then dead-lettered (`max_deliver` −1 on the server)."""
    return (failure is not None and is_outage(failure)) or delivered < max_deliver


def retry_delay(backoff: float, delivered: int) -> float:
    """Twice `backoff` after the first delivery, doubling with each one, at most RETRY_DELAY_MAX_S."""
    return min(backoff * 2 ** min(delivered, 10), RETRY_DELAY_MAX_S)


async def announce_entry_change(js: JetStreamContext, change: MemoryEntryChanged, *, msg_id: str) -> None:
    """The change feed, after a commit; best-effort: the change itself is already durable."""
    try:
        await js.publish(
            event_subject(change.project_id, change.kind.value),
            change.model_dump_json().encode(),
            stream=EVENTS_STREAM,
            headers={"Nats-Msg-Id": msg_id},
        )
    except Exception as exc:
        if not is_outage(exc):
            log.exception("could not publish change event", extra={"change": change.kind.value})
            return
        # The client keeps it in its buffer across a reconnect: it is likely sent once the bus is back.
        log.warning("change event not acknowledged while NATS is away (%s): sent once reconnected, if the client's "
                    "buffer holds it", str(exc) or type(exc).__name__, extra={"change": change.kind.value})
