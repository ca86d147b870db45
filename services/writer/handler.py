"""A partition's write messages in, one decision each: decode, apply through shared.writes, ack, announce.

A memory whose write may wait on a model (a merge, arbitration), or that another transaction holds (another
replica's lane, an API edit), is set aside in a lane of its own, its later writes queued behind it there,
while the partition goes on with the other memories: a slow model holds up its own memory's writes, not its
neighbours'. A memory's writes are decided in their order either way.

Error map of this edge: a payload that does not decode is dead-lettered at once (retrying cannot fix it);
an outage of the database, the bus or a remote embedder is waited out in place, in order, for as long as it lasts;
any other failure
is retried and dead-lettered after MEMORIES_MAX_DELIVER deliveries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError

from shared import bus, metrics
from shared.batching import Coalescer
from shared.embeddings import EmbeddingError
from shared.events import MemoryEntryChanged, MemoryWriteOutcome, MemoryWriteRequested, WriteError
from shared.ids import EVENT_PREFIX, new_id
from shared.logs import log_context
from shared.settings import Settings
from shared.writes import AppliedWrite, Deferred, PreparedWrite, WriteApplier

log = logging.getLogger("memories.writer")


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A partition's decodable messages with their prepared writes, in order; or why preparing failed."""

    events: list[tuple[Msg, MemoryWriteRequested]]
    prepared: list[PreparedWrite]
    failure: Exception | None = None

    def part(self, indices: Sequence[int]) -> PreparedBatch:
        """The writes at `indices`, in that order."""
        prepared = [self.prepared[i] for i in indices] if self.prepared else []
        return PreparedBatch([self.events[i] for i in indices], prepared, self.failure)


class WriteHandler:
    def __init__(self, applier: WriteApplier, nc: NatsClient, settings: Settings, *, model_lanes: int) -> None:
        """`model_lanes`: how many memories' set-aside writes are decided at once (each holds a database
        connection while its model answers)."""
        self._applier = applier
        # Partitions whose batches are prepared while a transaction runs share the next one.
        # Nothing is waited for there (a memory another transaction holds, a model): such writes are set aside.
        self._decide_together = Coalescer(
            partial(applier.decide, defer_waits=True), max_batch=settings.memories_write_batch
        )
        self._nc = nc
        self._js = nc.jetstream()
        self._max_deliver = settings.memories_max_deliver
        self._backoff = settings.memories_retry_backoff_s
        self._ack_wait_s = settings.memories_ack_wait_s
        self._stop = asyncio.Event()
        self._lanes: dict[str, asyncio.Task[None]] = {}  # memory id → the last of its set-aside writes' tasks
        self._set_aside_messages: dict[asyncio.Task[None], list[Msg]] = {}  # every lane not finished, and its writes
        self._lane_slots = asyncio.Semaphore(model_lanes)
        # Memories a write of which was handed back as the writer stops: their later writes, in any batch or lane,
        # go back after it untried (decided now, they would be decided before it).
        self._handed_back: set[str] = set()

    async def prepare(self, messages: Sequence[Msg]) -> PreparedBatch:
        """A partition's fetched messages made ready for their decisions, outside any lock: decoded (a
        malformed one is dead-lettered here), exact copies found and the other texts embedded."""
        events: list[tuple[Msg, MemoryWriteRequested]] = []
        for message in messages:
            event = await self._decode(message)
            if event is not None:
                events.append((message, event))
        if not events:
            return PreparedBatch([], [])
        try:
            return PreparedBatch(events, await self._applier.prepare([event for _, event in events]))
        except Exception as exc:  # noqa: BLE001 - an outage, mostly: every write of the batch is retried
            return PreparedBatch(events, [], failure=exc)

    async def finish(self, batch: PreparedBatch) -> None:
        """Decide a prepared batch in its order, then acknowledge, answer and announce each write; the writes of
        a memory that may wait on a model, or that has writes set aside in this partition already, go to that
        memory's lane."""
        batch = await self._prepared_through_outages(batch)
        memories = {event.memory_id for _, event in batch.events if event.memory_id in self._lanes}
        memories.update(one.event.memory_id for one in batch.prepared if self._applier.may_wait_on_a_model(one))
        if memories:
            aside = [i for i, (_, event) in enumerate(batch.events) if event.memory_id in memories]
            self._set_aside(batch, aside)
            batch = batch.part([i for i, (_, event) in enumerate(batch.events) if event.memory_id not in memories])
        await self._conclude(batch)

    async def _prepared_through_outages(self, batch: PreparedBatch) -> PreparedBatch:
        """A batch whose preparing met an outage is prepared again once it is over, waited out in place as
        decisions are (`_decide_through_outages`): which of its writes may wait on a model is known only then."""
        pause = self._backoff
        while batch.failure is not None and bus.is_outage(batch.failure) and not self._stop.is_set():
            pause = await self._wait_out(batch.failure, pause)
            batch = await self.prepare([message for message, _ in batch.events])
        return batch

    async def _wait_out(self, outage: Exception, pause: float) -> float:
        """A wait in place for an outage to end (cut short by a stop); the next pause. An embedder's lasts until it
        answers a probe: decided again before, a set-aside merge would ask its model again at every pause (its
        rewrite is checked by its embedding, after the model answered)."""
        while True:
            log.warning("outage: the batch waits in place, in order (%s)", str(outage) or "unreachable")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), pause)
            pause = min(pause * 2, bus.RETRY_DELAY_MAX_S)
            if self._stop.is_set() or not isinstance(outage, EmbeddingError) or await self._applier.embedder_answers():
                return pause

    def _set_aside(self, batch: PreparedBatch, indices: Sequence[int]) -> None:
        """The writes at `indices`, each memory's in a lane after the writes it has set aside already: decided
        in their order without holding up the partition."""
        lanes: dict[str, list[int]] = {}
        for i in indices:
            lanes.setdefault(batch.events[i][1].memory_id, []).append(i)
        for memory_id, own in lanes.items():
            writes = batch.part(own)
            messages = [message for message, _ in writes.events]
            lane = asyncio.create_task(self._decide_in_lane(self._lanes.get(memory_id), writes, messages))
            self._lanes[memory_id] = lane
            self._set_aside_messages[lane] = messages
            lane.add_done_callback(partial(self._close_lane, memory_id))

    def _close_lane(self, memory_id: str, lane: asyncio.Task[None]) -> None:
        self._set_aside_messages.pop(lane, None)
        if self._lanes.get(memory_id) is lane:  # no later writes of the memory set aside behind it
            del self._lanes[memory_id]

    async def _decide_in_lane(
        self, before: asyncio.Task[None] | None, writes: PreparedBatch, messages: list[Msg]
    ) -> None:
        metrics.WRITES_SET_ASIDE.inc(len(writes.events))
        try:
            async with bus.kept_in_progress(messages, self._ack_wait_s):
                if before is not None:
                    await asyncio.wait({before})
                async with self._lane_slots:
                    # One write per transaction: the memory's lock (and its edits) waits on one model answer at a
                    # time, and each write is answered as soon as it is decided.
                    for i in range(len(messages)):
                        await self._conclude(writes.part([i]), in_lane=True)
        except Exception:  # the steps handle their own failures; this is a bug, and the writes are redelivered
            log.exception("set-aside writes failed")
        finally:
            metrics.WRITES_SET_ASIDE.dec(len(writes.events))

    async def finish_lanes(self, timeout: float) -> None:
        """On stopping: the set-aside writes are decided within `timeout`, or cancelled (their transactions roll
        back) and handed back at once, in the order they were published: left to the ack wait, they would come back
        after writes published later (MEMORIES_ACK_WAIT_S), which the next writer would decide first."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while pending := {lane for lane in self._set_aside_messages if not lane.done()}:
            left = deadline - loop.time()
            if left <= 0:
                undecided = [m for lane in pending for m in self._set_aside_messages[lane]]
                for lane in pending:
                    lane.cancel()
                await asyncio.wait(pending)
                handed_back = [message for message in undecided if not message.is_acked]
                # Said, so that an operator can tell a stop that left writes to the next writer from one that did not.
                log.info("stopping: %d set-aside writes handed back undecided", len(handed_back))
                await bus.hand_back(handed_back)
                return
            await asyncio.wait(pending, timeout=left)

    async def _conclude(self, batch: PreparedBatch, *, in_lane: bool = False) -> None:
        """Decide the writes in their order, then acknowledge, answer and announce each. In a lane, each
        decision may wait for its memory and a model; elsewhere the writes that would wait are set aside (`Deferred`).
        A stopping writer hands back, untried, the writes of a memory it handed a write back of."""
        behind = [message for message, event in batch.events if event.memory_id in self._handed_back]
        if behind:
            await bus.hand_back(behind)
            batch = batch.part([i for i, (_, event) in enumerate(batch.events) if event.memory_id not in self._handed_back])
        if not batch.events:
            return
        results = await self._decide_through_outages(batch, in_lane=in_lane)
        self._set_aside(batch, [i for i, result in enumerate(results) if isinstance(result, Deferred)])
        announcements = []
        for (message, event), result in zip(batch.events, results, strict=True):
            if isinstance(result, Deferred):
                continue
            # Every line logged while this write is handled, here or in shared code, names it (a task
            # created in this context keeps it).
            with log_context(write_id=event.write_id, memory_id=event.memory_id):
                try:
                    if isinstance(result, Exception):
                        if self._stop.is_set() and bus.is_outage(result):  # handed back, not waited out
                            self._handed_back.add(event.memory_id)
                        await self._retry_or_give_up(message, event, result)
                    else:
                        # Announced whatever becomes of its ack: delivered again, it would be a replay, which
                        # announces nothing.
                        announcements.append(asyncio.create_task(self._announce(event, result)))
                        await self._settle(message, event, result)
                except nats.errors.Error as exc:
                    # The bus failed this write's dead letter, ack or answer: the batch's other writes are settled
                    # all the same. Unacknowledged, it comes back after the ack wait and is answered from its stored
                    # outcome, not decided again; unanswered, its caller gets a 202 and finds the outcome by its id.
                    log.warning("could not settle the write: %s", str(exc) or type(exc).__name__)
        # The change feed's acknowledgements are awaited together, not one round trip per write. The tasks
        # start in decision order and each sends before it first waits, so the feed keeps that order.
        await asyncio.gather(*announcements)

    async def _decide_through_outages(
        self, batch: PreparedBatch, *, in_lane: bool = False
    ) -> Sequence[AppliedWrite | Deferred | Exception]:
        """The batch's results. An outage (the database or the bus unreachable) is waited out in place, the
        messages kept in progress, instead of handing them back: redelivered, each after a backoff that grows
        with its own deliveries, a memory's writes would come back out of order (a later fact decided first).
        What was decided before the outage stands; the writes it stopped are decided again, in order."""
        pause = self._backoff
        results = await self._decide(batch, in_lane)
        while not self._stop.is_set():
            stopped = [i for i, result in enumerate(results) if isinstance(result, Exception) and bus.is_outage(result)]
            if not stopped:
                break
            pause = await self._wait_out(results[stopped[0]], pause)
            for i, result in zip(stopped, await self._decide(batch.part(stopped), in_lane), strict=True):
                results[i] = result
        return results

    def stop(self) -> None:
        """The writer stops: an outage is no longer waited out, its writes are handed back (redelivered)."""
        self._stop.set()

    async def _decide(self, batch: PreparedBatch, in_lane: bool) -> list[AppliedWrite | Deferred | Exception]:
        """One result per write: its decision, or the exception that stopped it (preparing it, or the shared steps).
        Partitions' batches share one transaction at a time, which waits for nothing (a write that would wait for its
        memory or a model gets `Deferred`); a lane's writes have their own, which waits for both."""
        if batch.failure is not None:
            return [batch.failure] * len(batch.events)
        try:
            if in_lane:
                return await self._applier.decide(batch.prepared)
            return list(await self._decide_together(batch.prepared))
        except Exception as exc:  # noqa: BLE001 - the shared steps failed (an outage, mostly): all are retried
            return [exc] * len(batch.events)

    async def _decode(self, message: Msg) -> MemoryWriteRequested | None:
        """The message's event; None when it was dead-lettered (retrying cannot fix a malformed one)."""
        try:
            event = MemoryWriteRequested.model_validate_json(message.data)
        except ValidationError as exc:
            payload = _payload_of(message.data)
            write_id, memory_id = _text(payload, "event_id"), message.subject.rsplit(".", 1)[-1]
            with log_context(write_id=write_id, memory_id=memory_id):
                await self._dead_letter_undecidable(
                    message, f"invalid write event: {exc.errors()[:3]}", write_id, memory_id,
                    _text(payload, "reply_subject"),
                )
            return None
        if not message.subject.endswith(f".{event.memory_id}"):
            with log_context(write_id=event.write_id, memory_id=event.memory_id):
                await self._dead_letter_undecidable(
                    message, "subject does not name the event's memory", event.write_id, event.memory_id,
                    event.reply_subject,
                )
            return None
        return event

    async def _dead_letter_undecidable(
        self, message: Msg, reason: str, write_id: str | None, memory_id: str, reply_subject: str | None
    ) -> None:
        """A write event this writer cannot decide (sent by a newer or broken API: unreadable, or on another memory's
        subject) is dead-lettered, retrying cannot fix it; its write must not stay pending for ever, and its caller
        need not wait out the timeout: both are told it failed. When the bus does not take the dead letter, the
        message stays unacknowledged and comes back after the ack wait; the rest of its batch is decided meanwhile."""
        try:
            await self.dead_letter(message.subject, message.data, reason=reason)
            await message.ack()
        except nats.errors.Error as exc:
            log.warning("could not dead-letter the undecidable write: %s", str(exc) or type(exc).__name__)
            return
        if write_id is None:
            return
        told = "the writer could not decide this write's event; it was set aside for an operator"
        metrics.observe_write_failure("INTERNAL_ERROR")
        try:
            await self._applier.fail_pending(write_id, memory_id, "INTERNAL_ERROR", told)
        except Exception:  # the dead letter holds the write; only its status is stale
            log.exception("could not record the unreadable write as failed")
        if reply_subject is None:
            return
        outcome = MemoryWriteOutcome(write_id=write_id, error=WriteError(code="INTERNAL_ERROR", message=told, status=500))
        try:
            await self._nc.publish(reply_subject, outcome.model_dump_json().encode())
        except nats.errors.Error as exc:  # a reply subject as broken as the rest of the event
            log.warning("could not answer the unreadable write: %s", exc)

    async def _retry_or_give_up(self, message: Msg, event: MemoryWriteRequested, exc: Exception) -> None:
        delivered = bus.deliveries(message)
        if bus.retried(delivered, self._max_deliver, exc):
            log.warning("write failed, will retry", extra={"attempt": delivered}, exc_info=exc)
            # A stopping writer hands writes back at once, in the order it meets them, as it does those set aside: a
            # delay grown with each one's own deliveries would bring a memory's writes back out of order.
            await message.nak(delay=None if self._stop.is_set() else bus.retry_delay(self._backoff, delivered))
            return
        log.error("write failed, giving up", extra={"attempt": delivered}, exc_info=exc)
        # Recorded before it is acknowledged: a write given up on must not stay pending for ever. A failed
        # attempt is stored as no effect, so a replay from the dead letters or a retry with the write's
        # Idempotency-Key may still apply it.
        reason = f"the write could not be applied after {delivered} attempts and was set aside for an operator"
        try:
            applied: AppliedWrite | None = await self._applier.record_failure(event, "INTERNAL_ERROR", reason)
        except Exception as failure:
            if bus.is_outage(failure):  # it comes back once the database does, and is given up on again
                log.warning("could not record the write as failed: %s", failure)
                await message.nak(delay=None if self._stop.is_set() else bus.retry_delay(self._backoff, delivered))
                return
            # What failed the write fails its record too (a value the table cannot hold): the dead letter holds it.
            log.exception("could not record the write as failed; its status stays pending")
            applied = None
        await self.dead_letter(message.subject, message.data, reason=f"gave up after {delivered}: {exc!r}")
        await message.ack()
        if applied is None:
            return
        _count(event, applied)
        if event.reply_subject:
            await self._nc.publish(event.reply_subject, applied.outcome.model_dump_json().encode())

    async def _settle(self, message: Msg, event: MemoryWriteRequested, applied: AppliedWrite) -> None:
        # Counted at commit, before the ack: a lost ack comes back as a replay and is not counted twice.
        _count(event, applied)
        if applied.rejected:
            await self.dead_letter(message.subject, message.data, reason=applied.rejected)
        await message.ack()
        outcome = applied.outcome
        if outcome.error is not None:
            log.warning("write failed", extra={"error_code": outcome.error.code, "error": outcome.error.message})
        else:
            log.info(
                "write decided",
                extra={"action": outcome.action, "entry_id": outcome.entry_id, "replayed": applied.replayed},
            )
        if event.reply_subject:  # the waiting API's answer, sent after the commit and the ack
            await self._nc.publish(event.reply_subject, outcome.model_dump_json().encode())

    async def _announce(self, event: MemoryWriteRequested, applied: AppliedWrite) -> None:
        """After commit: feed the change stream. Losing it loses no data."""
        if applied.change is not None and applied.outcome.entry_id:
            change = MemoryEntryChanged(
                event_id=new_id(EVENT_PREFIX),
                project_id=event.project_id,
                memory_id=event.memory_id,
                entry_id=applied.outcome.entry_id,
                kind=applied.change,
                write_id=event.write_id,
                superseded_entry_id=applied.superseded_entry_id,
            )
            await bus.announce_entry_change(self._js, change, msg_id=f"{event.write_id}:{applied.change.value}")

    async def dead_letter(self, subject: str, body: bytes, *, reason: str) -> None:
        await bus.dead_letter(self._js, "writer", subject, body, reason=reason)


def _count(event: MemoryWriteRequested, applied: AppliedWrite) -> None:
    if applied.replayed:
        return
    outcome = applied.outcome
    if outcome.error is not None:
        metrics.observe_write_failure(outcome.error.code)
    elif outcome.action is not None:
        metrics.observe_write_decision(outcome.action.value, event.source_type.value, event.occurred_at)


def _payload_of(body: bytes) -> dict[str, Any]:
    """What can still be read of a write event that does not validate: its JSON object, if it parses at all."""
    try:
        payload = json.loads(body)
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


def _text(payload: dict[str, Any], key: str) -> str | None:
    value = payload.get(key)
    return value if isinstance(value, str) else None
