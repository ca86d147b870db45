"""Consuming one partition of MEMORY_WRITES in order, a batch at a time, two stages deep.

FastStream's pull subscribers either run a fetched batch concurrently or wait to fill it, so the writer
fetches its partitions itself: `fetch` returns what is queued (up to the batch size) at once, or waits for
the first message. A batch goes through two stages: `prepare` (no lock held: the embeddings, the expensive
part) and `finish` (the decisions, in order, then the acks). While one batch is finished the next one is
fetched and prepared, so the serial part of a partition is its lookups, decisions and inserts; a batch is
finished only after the one before it. While a batch is in hand its messages are kept in progress, so a
slow model call does not let the ack wait hand them to another replica. `finish` may set a memory's writes
aside to wait on a model (services.writer.handler): the partition goes on, and they stay unacknowledged, within
the durable's `max_ack_pending`, until decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from shared import bus

log = logging.getLogger("memories.writer")

Prepared = TypeVar("Prepared")

FETCH_WAIT_S = 5.0
"""How long one fetch waits on an idle partition before it asks again."""

STALE_ANSWER_WAIT_S = 0.02
"""How long the next fetch waits after one timed out. The server's answer to the expired pull request (a 408
status) may still be on its way; nats-py's next fetch would take it for the answer to its own first request and
fall back to a request that waits for a whole batch, holding a lone write until its deadline (up to FETCH_WAIT_S:
measured, 5 to 7 of 150 lone messages held with a 0.3 s fetch, none with this pause). Arrived meanwhile, the stale
answer is discarded."""


class PartitionConsumer(Generic[Prepared]):
    def __init__(
        self,
        js: JetStreamContext,
        partition: int,
        prepare: Callable[[Sequence[Msg]], Awaitable[Prepared]],
        finish: Callable[[Prepared], Awaitable[None]],
        *,
        batch: int,
        ack_wait_s: float,
    ) -> None:
        self._js = js
        self.partition = partition
        self._prepare = prepare
        self._finish = finish
        self._batch = batch
        self._ack_wait_s = ack_wait_s
        self._loop: asyncio.Task[None] | None = None
        self._in_hand: set[asyncio.Task[None]] = set()
        self._subscription: JetStreamContext.PullSubscription | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = asyncio.create_task(self._consume(), name=f"writer-partition-{self.partition}")

    async def stop(self, timeout: float) -> None:
        """Stop fetching, then finish the batches in hand (within `timeout`); unfinished messages are redelivered.

        A fetch under way is let finish (at most FETCH_WAIT_S, within `timeout`) rather than cancelled: cancelled, its pull
        request stays open on the server, and what it then delivers would sit unhandled until the ack wait
        expired (and the connection's drain would wait on it as long). What it brings is handed back at once."""
        self._stopping = True
        deadline = asyncio.get_running_loop().time() + timeout  # one budget for the fetch and the batches in hand
        if self._loop is not None:
            if not (await asyncio.wait({self._loop}, timeout=timeout))[0]:
                self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        if self._in_hand:
            await asyncio.wait(self._in_hand, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))

    async def _consume(self) -> None:
        try:
            await self._fetch_until_stopped()
        finally:  # no pull request of this loop left open for the connection's drain to wait on
            if self._subscription is not None:
                with contextlib.suppress(nats.errors.Error):
                    await self._subscription.unsubscribe()
                self._subscription = None

    async def _fetch_until_stopped(self) -> None:
        previous: asyncio.Task[None] | None = None
        while not self._stopping:
            try:
                if self._subscription is None:
                    self._subscription = await self._js.pull_subscribe_bind(
                        durable=bus.writer_durable(self.partition), stream=bus.WRITES_STREAM
                    )
                messages = await self._subscription.fetch(batch=self._batch, timeout=FETCH_WAIT_S)
            except TimeoutError:
                await asyncio.sleep(STALE_ANSWER_WAIT_S)
                continue
            except nats.errors.Error as exc:  # reconnecting, or the stream's leader is being elected
                log.warning("fetching partition %s failed: %s", self.partition, exc)
                await asyncio.sleep(1.0)
                continue
            if self._stopping:  # fetched while stopping: another replica (or the next start) takes them now
                for message in messages:
                    with contextlib.suppress(nats.errors.Error):
                        await message.nak()
                return
            prepared = asyncio.Event()
            # A task of its own: stopping waits for the batches in hand instead of abandoning one half-decided.
            current = asyncio.create_task(self._handle(messages, previous, prepared))
            self._in_hand.add(current)
            current.add_done_callback(self._in_hand.discard)
            # The next fetch waits for this batch to be prepared and the one before it to be finished: at most
            # bus.WRITE_BATCHES_IN_HAND batches in hand, besides the writes set aside (the durable's
            # max_ack_pending bounds them all).
            await prepared.wait()
            if previous is not None:
                await asyncio.wait({previous})
            previous = current

    async def _handle(self, messages: Sequence[Msg], previous: asyncio.Task[None] | None, prepared: asyncio.Event) -> None:
        try:
            async with bus.kept_in_progress(messages, self._ack_wait_s):
                try:
                    batch = await self._prepare(messages)
                finally:
                    prepared.set()
                if previous is not None:
                    await asyncio.wait({previous})  # decisions in partition order
                await self._finish(batch)
        except Exception:  # the stages handle their own failures; this is a bug, and the batch is redelivered
            log.exception("batch of partition %s failed", self.partition)
