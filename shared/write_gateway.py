"""Submitting a write and waiting for the writer's decision: used by every write route of the API, and
callable from Python by an agent platform that runs next to the service.

A submission of a caller-chosen write id (an Idempotency-Key, an extraction's derived id) claims it in the
database first (a pending record): a known id returns its stored outcome, an id another caller is already
publishing is awaited through the database. A fresh id needs no claim: nobody else can know it, so it is
published at once and recorded as pending only if the writer has not answered in time (for the 202).
Either way the event goes to JetStream with a reply subject of this process, and the caller waits.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection
from datetime import datetime

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import bus, write_records
from shared.db.models import WriteOutcome
from shared.events import MemoryWriteOutcome, MemoryWriteRequested
from shared.writes import outcome_of

log = logging.getLogger("memories.gateway")

_POLL_FIRST_S, _POLL_MAX_S = 0.05, 0.5
"""How often a caller waiting on another's attempt reads the write's record: often at first (a retry racing its first
call is usually answered within milliseconds), then less, so that many waiters (an extraction's facts re-asked while
the writer is down) do not query the database many times a second each."""


class IdempotencyKeyReused(Exception):
    """The write id (a client's Idempotency-Key) was first used for a different request."""

    def __init__(self, write_id: str) -> None:
        super().__init__(f"write {write_id} was first requested by a different request")
        self.write_id = write_id


def request_hash(event: MemoryWriteRequested) -> str:
    """What makes two requests the same write: the values the client chose, not the ids and times of delivery.
    Defaults are left out, so a field added to the event later (always with a default) leaves the hash of a
    retry that spans the upgrade unchanged."""
    chosen = event.model_dump(mode="json", exclude={"event_id", "occurred_at", "reply_subject"}, exclude_defaults=True)
    return hashlib.sha256(b"v1:" + json.dumps(chosen, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


class WriteGateway:
    def __init__(
        self,
        nc: NatsClient,
        sessions: async_sessionmaker[AsyncSession],
        partitions: int,
        *,
        on_memory_gone: Callable[[str], None] | None = None,
    ) -> None:
        """`on_memory_gone`: told of a memory a writer found deleted (the API's memory owners forget it, so that
        its next write, a REST one or a tool call, is refused without the bus)."""
        self._nc = nc
        self._sessions = sessions
        self._partitions = partitions
        self._on_memory_gone = on_memory_gone
        self._inbox = nc.new_inbox()  # under the process's own inbox prefix: its user's alone (shared.bus_permissions)
        self._waiting: dict[str, asyncio.Future[MemoryWriteOutcome]] = {}

    async def start(self) -> None:
        await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        try:
            outcome = MemoryWriteOutcome.model_validate_json(msg.data)
        except ValidationError:
            # The reply subject ends with the write id; the memory is not known from a malformed answer.
            ids = {"write_id": msg.subject.rsplit(".", 1)[-1], "memory_id": None}
            log.error("malformed write outcome on %s", msg.subject, extra=ids)
            return
        future = self._waiting.get(outcome.write_id)
        if future is not None and not future.done():
            future.set_result(outcome)

    async def submit(
        self,
        event: MemoryWriteRequested,
        *,
        timeout: float,
        fresh_id: bool = False,
        client_key: bool = False,
        retry_failed: Collection[str] | None = None,
        order: PublishOrder | None = None,
    ) -> MemoryWriteOutcome | None:
        """The write's outcome, or None when the writer has not decided within `timeout` (it stays queued).

        `fresh_id`: the write id was generated for this call alone (no Idempotency-Key).
        `client_key`: the write id comes from a client's Idempotency-Key, which must name one request only.
        `retry_failed`: an earlier attempt that failed is tried again only if it failed with one of these codes
        (None: whatever the code); otherwise its failure is the outcome.
        `order`: this write's place among writes submitted together, published in that order (`PublishOrder`).
        Raises bus.BusUnavailable when JetStream does not take the event; a retry with the same write id is safe.
        Raises IdempotencyKeyReused when the id was first used for a different request.
        """
        try:
            outcome = await self._submit(event, timeout, fresh_id, client_key, retry_failed, order)
        except BaseException:
            if order is not None:
                order.fail()  # not published: the next must not go before it
            raise
        if order is not None:
            order.done()  # published, or settled without a publish (decided before): the next may go
        return outcome

    async def _submit(
        self,
        event: MemoryWriteRequested,
        timeout: float,
        fresh_id: bool,
        client_key: bool,
        retry_failed: Collection[str] | None,
        order: PublishOrder | None,
    ) -> MemoryWriteOutcome | None:
        deadline = time.monotonic() + timeout
        if fresh_id:
            outcome = await self._publish_and_wait(event, attempt=0, deadline=deadline, order=order)
            if outcome is None:
                await self._record_pending(event)
            return outcome
        fingerprint = request_hash(event) if client_key else None
        while True:
            record, owned = await self._claim(event, fingerprint, retry_failed)
            if write_records.claimed_by_another_request(record, fingerprint):
                raise IdempotencyKeyReused(event.write_id)
            if record.status == "applied":
                return ReplayedOutcome.of(record)
            if owned:
                break
            try:
                return await self._await_stored(event.write_id, deadline, claimed_at=record.updated_at)
            except _ClaimChanged:
                continue  # claimed again: published here if its owner gave it up (a 503), else awaited anew
        try:
            outcome = await self._publish_and_wait(event, attempt=record.failed_attempts, deadline=deadline, order=order)
        except bus.BusUnavailable:
            await self._release_claim(event.write_id, claimed_at=record.updated_at)
            raise
        if outcome is None:
            await self._record_published(event.write_id, claimed_at=record.updated_at)
        return outcome

    async def _claim(
        self, event: MemoryWriteRequested, fingerprint: str | None, retry_failed: Collection[str] | None
    ) -> tuple[WriteOutcome, bool]:
        """Record the write as pending unless its id is known: the stored record, and whether this call owns
        the attempt (see `write_records.claim_write_id`)."""
        async with self._sessions() as session:
            claimed = await write_records.claim_write_id(
                session, event.write_id, event.project_id, event.memory_id, request_hash=fingerprint,
                retry_failed=retry_failed,
            )
            await session.commit()
        return claimed

    async def _record_pending(self, event: MemoryWriteRequested) -> None:
        """A published write the writer has not decided in time is recorded as pending, so that the 202's write
        id can be looked up while it waits in the queue. The write is queued whether or not this succeeds: with
        the database down (the likely reason the writer is late), the caller still gets its 202 and write id,
        never an error for a write that will be applied; the writer's outcome creates the record later."""
        try:
            async with self._sessions() as session:
                await write_records.record_pending_write(session, event.write_id, event.project_id, event.memory_id)
                await session.commit()
        except SQLAlchemyError:
            log.warning("could not record write %s as pending; it stays queued", event.write_id, exc_info=True)

    async def _record_published(self, write_id: str, *, claimed_at: datetime) -> None:
        """The claimed write is queued and not decided in time: a retry of its key is to wait for it, not publish
        it again (past the bus's duplicate window, that queued a copy each time). Not recorded (the database is
        down), a retry publishes it again, as before."""
        try:
            async with self._sessions() as session:
                await write_records.record_published(session, write_id, claimed_at)
                await session.commit()
        except SQLAlchemyError:
            log.warning("could not record write %s as published", write_id, exc_info=True)

    async def _release_claim(self, write_id: str, *, claimed_at: datetime) -> None:
        try:
            async with self._sessions() as session:
                await write_records.release_write_claim(session, write_id, claimed_at)
                await session.commit()
        except SQLAlchemyError:  # the database is down too: the claim goes stale by itself
            log.warning("could not release the claim of write %s", write_id, exc_info=True)

    async def _publish_and_wait(
        self, event: MemoryWriteRequested, *, attempt: int, deadline: float, order: PublishOrder | None = None
    ) -> MemoryWriteOutcome | None:
        """Publish, then wait for the writer's outcome until `deadline` (time.monotonic): a wait for the writes
        before it in `order` counts too."""
        event = event.model_copy(update={"reply_subject": f"{self._inbox}.{event.write_id}"})
        # Registered before publishing: the answer can arrive before the publish acknowledgement.
        future: asyncio.Future[MemoryWriteOutcome] = asyncio.get_running_loop().create_future()
        self._waiting[event.write_id] = future
        try:
            if order is not None:
                await order.turn()
            await bus.publish_or_refuse(
                self._nc,
                bus.write_subject(event.memory_id, self._partitions),
                # Unset optional fields stay off the wire: an added one is then invisible to older readers.
                event.model_dump_json(exclude_none=True).encode(),
                stream=bus.WRITES_STREAM,
                # A failed attempt gets a new message id, so the duplicate window cannot swallow the retry.
                msg_id=f"{event.write_id}.{attempt}",
            )
            if order is not None:
                order.done()
            try:
                outcome = await asyncio.wait_for(future, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return None
        finally:
            self._waiting.pop(event.write_id, None)
        if outcome.error is not None and outcome.error.code == "RESOURCE_NOT_FOUND" and self._on_memory_gone:
            self._on_memory_gone(event.memory_id)
        return outcome

    async def _await_stored(
        self, write_id: str, deadline: float, *, claimed_at: datetime
    ) -> MemoryWriteOutcome | None:
        """Another caller owns this write's attempt; its outcome shows up in the database. None when it does not
        in time (a 202: the write is queued). Raises _ClaimChanged when the claim changed hands: its owner gave it
        up unpublished, or another caller took it over."""
        pause = _POLL_FIRST_S
        while time.monotonic() < deadline:
            async with self._sessions() as session:
                record = await write_records.get_write_outcome(session, write_id)
            if record is not None and record.status != "pending":
                return ReplayedOutcome.of(record)
            if record is not None and record.updated_at != claimed_at:
                # Given up unpublished by its owner (aged by `write_records.release_write_claim`), or taken over by
                # another caller since: claimed again, to be published here or awaited anew.
                raise _ClaimChanged
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, _POLL_MAX_S)
        return None


class _ClaimChanged(Exception):
    pass


class PublishOrder:
    """The place of one write among writes submitted together (a turn's facts): each is published once the one
    before it was, or was settled without a publish (decided before), so that the writer decides them in the order
    given, a later fact after the earlier one it may correct. Claims and waits still run side by side. When one
    fails unpublished (the bus down), the ones after it fail too (`Broken`) rather than go first: the caller submits
    them all again. `PublishOrder.chain(n)`: the places of n writes."""

    class Broken(Exception):
        """A write before this one failed unpublished."""

    def __init__(self, before: PublishOrder | None) -> None:
        self._before = before
        self._settled = asyncio.Event()
        self._failed = False

    @classmethod
    def chain(cls, count: int) -> list[PublishOrder]:
        places: list[PublishOrder] = []
        for _ in range(count):
            places.append(cls(places[-1] if places else None))
        return places

    @staticmethod
    def cause(failed: BaseExceptionGroup[BaseException]) -> BaseException:
        """What stopped writes submitted together: the failure itself, not the `Broken` ones after it."""
        return next((e for e in failed.exceptions if not isinstance(e, PublishOrder.Broken)), failed.exceptions[0])

    async def turn(self) -> None:
        if self._before is not None:
            await self._before._settled.wait()
            if self._before._failed:
                raise PublishOrder.Broken("a write before this one was not published")

    def done(self) -> None:
        self._settled.set()

    def fail(self) -> None:
        if not self._settled.is_set():  # once published, a later failure (the wait's) holds up none after it
            self._failed = True
            self._settled.set()


class ReplayedOutcome(MemoryWriteOutcome):
    """The stored outcome of an earlier call with this write id (a retry, a repeated Idempotency-Key, a caller
    that published it first): this call decided nothing. It does not carry the entry."""

    @classmethod
    def of(cls, record: WriteOutcome) -> ReplayedOutcome:
        return cls(**outcome_of(record).model_dump())
