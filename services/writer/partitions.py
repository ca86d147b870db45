"""Consuming one partition of MEMORY_WRITES in order, a batch at a time.

FastStream's pull subscribers either run a fetched batch concurrently or wait to fill it, so the writer
fetches its partitions itself: `fetch` returns what is queued (up to the batch size) at once, or waits for
the first message. The batch is handed over whole and finished before the next fetch; while it runs, its
messages are kept in progress so that a slow model call does not let the ack wait hand them to another
replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import bus

log = logging.getLogger("memories.writer")

HandleBatch = Callable[[Sequence[Msg]], Awaitable[None]]

FETCH_WAIT_S = 5.0
"""How long one fetch waits on an idle partition before it asks again."""


class PartitionConsumer:
    def __init__(
        self, js: JetStreamContext, partition: int, handle: HandleBatch, *, batch: int, ack_wait_s: float
    ) -> None:
        self._js = js
        self.partition = partition
        self._handle = handle
        self._batch = batch
        self._ack_wait_s = ack_wait_s
        self._loop: asyncio.Task[None] | None = None
        self._handling: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = asyncio.create_task(self._consume(), name=f"writer-partition-{self.partition}")

    async def stop(self, timeout: float) -> None:
        """Finish the batch in hand (within `timeout`), then stop fetching; unfinished messages are redelivered."""
        self._stopping = True
        if self._handling is not None:
            await asyncio.wait({self._handling}, timeout=timeout)
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop

    async def _consume(self) -> None:
        subscription = None
        while not self._stopping:
            try:
                if subscription is None:
                    subscription = await self._js.pull_subscribe_bind(
                        durable=bus.writer_durable(self.partition), stream=bus.WRITES_STREAM
                    )
                messages = await subscription.fetch(batch=self._batch, timeout=FETCH_WAIT_S)
            except TimeoutError:
                continue
            except nats.errors.Error as exc:  # reconnecting, or the stream's leader is being elected
                log.warning("fetching partition %s failed: %s", self.partition, exc)
                await asyncio.sleep(1.0)
                continue
            self._handling = asyncio.create_task(self._handle_in_progress(messages))
            # Shielded: stopping waits for the batch instead of abandoning it half-decided.
            await asyncio.shield(self._handling)
            self._handling = None

    async def _handle_in_progress(self, messages: Sequence[Msg]) -> None:
        heartbeat = asyncio.create_task(self._keep_in_progress(messages))
        try:
            await self._handle(messages)
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    async def _keep_in_progress(self, messages: Sequence[Msg]) -> None:
        while True:
            await asyncio.sleep(self._ack_wait_s / 3)
            for message in messages:
                if not message.is_acked:
                    with contextlib.suppress(nats.errors.Error):
                        await message.in_progress()
