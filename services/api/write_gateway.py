"""Publishes write events to JetStream and waits for the writer's answer on a subject of this process."""

from __future__ import annotations

import asyncio
import logging
import uuid

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from pydantic import ValidationError

from shared import bus
from shared.events import MemoryWriteOutcome, MemoryWriteRequested

log = logging.getLogger("memories.api")

PUBLISH_TIMEOUT_S = 5.0
"""How long JetStream may take to acknowledge a publish before the bus counts as unavailable."""


class BusUnavailable(Exception):
    pass


class WriteGateway:
    def __init__(self, nc: NatsClient, partitions: int) -> None:
        self._nc = nc
        self._js = nc.jetstream()
        self._partitions = partitions
        self._inbox = f"_INBOX.memories.{uuid.uuid4().hex}"
        self._waiting: dict[str, asyncio.Future[MemoryWriteOutcome]] = {}

    async def start(self) -> None:
        await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        try:
            outcome = MemoryWriteOutcome.model_validate_json(msg.data)
        except ValidationError:
            log.error("malformed write outcome on %s", msg.subject)
            return
        future = self._waiting.get(outcome.write_id)
        if future is not None and not future.done():
            future.set_result(outcome)

    async def submit(self, event: MemoryWriteRequested, *, attempt: int, timeout: float) -> MemoryWriteOutcome | None:
        """Publish and wait up to `timeout`; None means the writer has not answered yet (the write stays queued)."""
        event = event.model_copy(update={"reply_subject": f"{self._inbox}.{event.write_id}"})
        # Registered before publishing: the answer can arrive before the publish acknowledgement.
        future: asyncio.Future[MemoryWriteOutcome] = asyncio.get_running_loop().create_future()
        self._waiting[event.write_id] = future
        try:
            try:
                await self._js.publish(
                    bus.write_subject(event.memory_id, self._partitions),
                    event.model_dump_json().encode(),
                    stream=bus.WRITES_STREAM,
                    timeout=PUBLISH_TIMEOUT_S,
                    # A failed attempt gets a new message id, so the duplicate window cannot swallow the retry.
                    headers={"Nats-Msg-Id": f"{event.write_id}.{attempt}"},
                )
            except (TimeoutError, NatsError, OSError) as exc:
                raise BusUnavailable(str(exc) or type(exc).__name__) from exc
            try:
                return await asyncio.wait_for(asyncio.shield(future), timeout)
            except TimeoutError:
                return None
        finally:
            self._waiting.pop(event.write_id, None)
