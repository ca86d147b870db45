"""Consuming one partition of MEMORY_WRITES in order, a batch at a time, two stages deep.

A partition's durable is pinned to one writer replica at a time (bus.writer_consumer); the others' pull requests
wait, so a memory's writes are decided in the order they were published however many replicas run. nats-py's
fetch knows no priority groups, and FastStream's pull subscribers either run a fetched batch concurrently or wait
to fill it, so the writer pulls its partitions itself (`PinnedPull`): one pull returns what is queued (up to the
batch size) at once, or waits for the first message. A batch goes through two stages: `prepare` (no lock held:
the embeddings, the expensive part) and `finish` (the decisions, in order, then the acks). While one batch is
finished the next one is fetched and prepared, so the serial part of a partition is its lookups, decisions and
inserts; a batch is finished only after the one before it. While a batch is in hand its messages are kept in
progress, so a slow model call does not let the ack wait hand them to another replica. `finish` may set a
memory's writes aside to wait on a model (services.writer.handler): the partition goes on, and they stay
unacknowledged, within the durable's `max_ack_pending`, until decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared import bus

log = logging.getLogger("memories.writer")

Prepared = TypeVar("Prepared")

FETCH_WAIT_S = 2.0
"""How long one pull waits on an idle partition (or, for a replica the partition is not pinned to, for its turn)
before it asks again; a stopping writer lets the pull under way finish. Well within bus.PIN_MARGIN_S."""

QUEUED_WAIT_S = 0.001
"""How long the request for what is queued with a first message waits for more: a write arriving meanwhile joins."""

TAKEOVER_WAIT_S = 0.05
"""The same, for a replica the partition is not pinned to yet: a crashed replica's writes, all due at once, reach
the server's delivery queue over a few milliseconds (measured: one fetch in 40 took 4 of 32 with a 1 ms wait)."""

HOLD_OFF_ACK_WAITS = 2
HOLD_OFF_PULL_S = 0.5
"""A replica just given a partition that another still holds writes of waits for them (`_after_the_former_holder`)
at most this many ack waits, pulling this often for the ones that come back."""

KEEP_PIN_EVERY_S = 1.0
"""How often a replica that holds a partition and has no pull open (its loop waits for a slow batch, or for a
database that is down) tells the server it is alive, so the pin outlasts what the replica holds."""

RECONNECT_CHECK_S = 0.5
"""How often a waiting pull looks whether the connection was re-established (which loses the request)."""

ANSWER_GRACE_S = 1.0
"""How long past its own expiry a pull waits for the server's last word on it before giving it up."""

PIN_HEADER = "Nats-Pin-Id"


class PinnedPull:
    """Pull requests for one partition's durable, as a member of its priority group (bus.WRITERS_GROUP).

    JetStream answers the replica the partition is pinned to; the first message after it pins this one carries
    the pin's id, which every later request names. A request naming a pin that has moved on is answered 423, and
    this replica waits its turn again. Each request has a reply subject of its own, so a late status of one (a
    timed-out request's 408) is never taken for the end of the next."""

    def __init__(self, nc: NatsClient, partition: int) -> None:
        self._nc = nc
        self._partition = partition
        durable = bus.writer_durable(partition)
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{bus.WRITES_STREAM}.{durable}"
        self._info_subject = f"$JS.API.CONSUMER.INFO.{bus.WRITES_STREAM}.{durable}"
        self._unpin_subject = f"$JS.API.CONSUMER.UNPIN.{bus.WRITES_STREAM}.{durable}"
        self._inbox = nc.new_inbox()
        self._requests = itertools.count()
        self._subscription: Subscription | None = None
        self._answering: tuple[str, asyncio.Queue[Msg]] | None = None
        self.pin: str | None = None

    async def fetch(self, batch: int, wait_s: float) -> list[Msg]:
        """What is queued, up to `batch`, as soon as there is a message; [] when none came within `wait_s`, or
        the partition is another replica's.

        Two requests: one for a single message, waiting up to `wait_s`, then one for what is queued with it, which
        expires almost at once (QUEUED_WAIT_S). A request marked `no_wait` would do both at once, but JetStream
        refuses one while another request waits ("408 Requests Pending"), and the other replicas' requests always
        wait; a request for the whole batch would wait until it is full."""
        if self._subscription is None:
            self._subscription = await self._nc.subscribe(f"{self._inbox}.*", cb=self._route)
        messages: list[Msg] = []
        taking_over = self.pin is None
        try:
            await self._request(1, wait_s, messages)
            if messages and batch > 1:
                await self._request(batch - 1, TAKEOVER_WAIT_S if taking_over else QUEUED_WAIT_S, messages)
        except asyncio.CancelledError:  # a stopping writer: what came is handed back, not left to the ack wait
            await bus.hand_back(messages)
            raise
        except nats.errors.Error:
            if not messages:
                raise
        return messages

    async def keep_pin(self) -> None:
        """Runs while the replica consumes the partition. A pin lapses PIN_MARGIN_S after the ack wait without a
        pull; writes held that long without a pull (kept in progress) would be fetched by the next replica after
        later ones. A request that can deliver nothing (at most 1 byte) counts as a pull: the server answers it
        409 (408 when nothing is queued), on a reply subject no request waits on. Ends with the connection."""
        while not self._nc.is_closed:
            await asyncio.sleep(KEEP_PIN_EVERY_S)
            if self.pin is None or self._answering is not None:
                continue
            with contextlib.suppress(nats.errors.Error):
                await self._ask(f"{self._inbox}.{next(self._requests)}", batch=1, max_bytes=1, expires=1_000_000)

    async def _ask(self, reply: str, **fields: int) -> None:
        """Send a pull request of the group, naming the pin this replica holds, if any."""
        request: dict[str, object] = {**fields, "group": bus.WRITERS_GROUP}
        if self.pin is not None:
            request["id"] = self.pin
        await self._nc.publish(self._next_subject, json.dumps(request).encode(), reply=reply)

    async def _request(self, count: int, expires_s: float, messages: list[Msg]) -> None:
        reply = f"{self._inbox}.{next(self._requests)}"
        answers: asyncio.Queue[Msg] = asyncio.Queue()
        self._answering = (reply, answers)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + expires_s + ANSWER_GRACE_S
        wanted = len(messages) + count
        reconnects = self._nc.stats["reconnects"]
        try:
            await self._ask(reply, batch=count, expires=int(expires_s * 1e9))
            while len(messages) < wanted:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return  # its end never came
                try:
                    answer = await asyncio.wait_for(answers.get(), min(remaining, RECONNECT_CHECK_S))
                except TimeoutError:
                    if self._nc.stats["reconnects"] != reconnects:
                        return  # a server that restarted, or another node, knows nothing of this request
                    continue
                status = (answer.headers or {}).get("Status")
                if status is None:
                    messages.append(answer)
                elif status in ("404", "408"):  # it expired
                    return
                elif status == "423":
                    # Another replica's now, or this one's pin lapsed (a NATS outage past its timeout): pulled again.
                    log.info("partition %s: this writer replica's pin is no longer valid", self._partition)
                    self.pin = None
                    return
                elif status != "100":  # 100: a heartbeat
                    if status == "400":  # e.g. the consumer lost its priority group (docs/operations.md): no pin now
                        self.pin = None
                    if messages:
                        return
                    raise nats.js.errors.APIError.from_msg(answer)
        finally:
            while not answers.empty():  # arrived as it was cancelled
                answer = answers.get_nowait()
                if not (answer.headers or {}).get("Status"):
                    messages.append(answer)
            self._answering = None

    def _note_pin(self, message: Msg) -> None:
        pin = (message.headers or {}).get(PIN_HEADER)
        if pin is not None and pin != self.pin:
            if self.pin is None:
                log.info("partition %s is this writer replica's now", self._partition)
            self.pin = pin

    async def _route(self, message: Msg) -> None:
        # A status comes on the request's reply subject; a message keeps its own subject.
        if (message.headers or {}).get("Status"):
            if self._answering is not None and message.subject == self._answering[0]:
                self._answering[1].put_nowait(message)
            return
        self._note_pin(message)  # whoever takes it: `release` must know the partition is pinned here
        if self._answering is not None:
            self._answering[1].put_nowait(message)
        else:  # delivered for a request given up on, none under way: back to the stream now, not after the ack wait
            await bus.hand_back([message])

    async def _consumer_info(self) -> dict[str, Any]:
        """The durable's state as the server reports it (nats-py's ConsumerInfo has no priority groups)."""
        info: dict[str, Any] = json.loads((await self._nc.request(self._info_subject, b"", timeout=2)).data)
        if "error" in info:
            raise nats.js.errors.APIError(description=str(info["error"]))
        return info

    async def unacknowledged(self) -> int:
        """Messages of the partition delivered to any replica and not yet acknowledged."""
        return int((await self._consumer_info())["num_ack_pending"])

    async def release(self) -> None:
        """Give the partition up at once (a stopping writer), so that a waiting replica need not wait out the
        pin's timeout. Only if it is still pinned here: unpinning another replica would move the partition for
        nothing, and let its batches in hand be overtaken."""
        pin, self.pin = self.pin, None
        if pin is None:
            return
        try:
            groups = (await self._consumer_info()).get("priority_groups") or []
            if any(group.get("pinned_client_id") == pin for group in groups):
                await self._nc.request(self._unpin_subject, json.dumps({"group": bus.WRITERS_GROUP}).encode(), timeout=2)
        except (nats.errors.Error, ValueError) as exc:
            # Said, since it shows: the partition stays pinned here until the pin lapses (the ack wait and
            # PIN_MARGIN_S), and the writes this replica handed back wait as long, ack-pending.
            log.warning("partition %s: could not give up its pin (%s): it lapses after the ack wait", self._partition, exc)

    async def close(self) -> None:
        if self._subscription is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._subscription.unsubscribe()
            self._subscription = None


class PartitionConsumer(Generic[Prepared]):
    def __init__(
        self,
        nc: NatsClient,
        partition: int,
        prepare: Callable[[Sequence[Msg]], Awaitable[Prepared]],
        finish: Callable[[Prepared], Awaitable[None]],
        *,
        batch: int,
        ack_wait_s: float,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        """`on_failure`: told why, when consuming the partition ended by a bug (the replica should stop)."""
        self.partition = partition
        self._on_failure = on_failure
        self._prepare = prepare
        self._finish = finish
        self._batch = batch
        self._ack_wait_s = ack_wait_s
        self._loop: asyncio.Task[None] | None = None
        self._in_hand: set[asyncio.Task[None]] = set()
        self._held: list[Msg] = []  # fetched and not yet acknowledged (in batches in hand, or set aside)
        self._pull = PinnedPull(nc, partition)
        self._keeping_pin: asyncio.Task[None] | None = None
        self._stopping = False

    def start(self) -> None:
        self._loop = asyncio.create_task(self._consume(), name=f"writer-partition-{self.partition}")
        self._loop.add_done_callback(self._loop_ended)
        self._keeping_pin = asyncio.create_task(self._pull.keep_pin(), name=f"writer-partition-{self.partition}-pin")

    def _loop_ended(self, loop: asyncio.Task[None]) -> None:
        if self._stopping:
            return
        # A bug: the partition must not stay pinned to a replica that no longer consumes it.
        if self._keeping_pin is not None:
            self._keeping_pin.cancel()
        if not loop.cancelled():
            log.error("consuming partition %s ended", self.partition, exc_info=loop.exception())
            if self._on_failure is not None:
                self._on_failure(f"consuming partition {self.partition} ended: {loop.exception()!r}")

    async def stop(self, timeout: float) -> None:
        """Stop fetching, then finish the batches in hand (within `timeout`); unfinished messages are redelivered.

        A pull under way is let finish (at most FETCH_WAIT_S, within `timeout`) rather than cancelled: the server
        would still answer it, and could pin the partition to it, a request nobody waits on (measured: a replica
        waiting its turn then waits out the pin's timeout). What it brings is handed back at once. The partition
        stays this replica's until `release`."""
        self._stopping = True
        deadline = asyncio.get_running_loop().time() + timeout  # one budget for the pull and the batches in hand
        if self._loop is not None:
            if not (await asyncio.wait({self._loop}, timeout=timeout))[0]:
                self._loop.cancel()
            await asyncio.wait({self._loop})  # however it ends (a loop that failed was logged as it ended)
        if self._in_hand:
            await asyncio.wait(self._in_hand, timeout=max(0.0, deadline - asyncio.get_running_loop().time()))

    async def release(self) -> None:
        """After `stop` and after the writes it set aside are decided or handed back: the partition goes to a
        waiting replica at once. Released earlier, that replica could fetch a memory's later writes before them;
        so a batch still in hand past the stop's budget keeps the partition pinned here, kept alive until the
        connection closes (its messages are kept in progress as long), and then until the pin lapses."""
        if self._in_hand:
            await self._pull.close()
            return
        if self._keeping_pin is not None:
            self._keeping_pin.cancel()
        await self._pull.release()
        await self._pull.close()

    async def _consume(self) -> None:
        previous: asyncio.Task[None] | None = None
        while not self._stopping:
            # Until this replica holds the partition, a pull may be the first after a crashed replica's: it asks
            # for all that one could have held, so that those writes come back in one batch, in order.
            batch = self._batch if self._pull.pin is not None else bus.WRITE_BATCHES_IN_HAND * self._batch
            pinned_before = self._pull.pin
            try:
                messages = await self._pull.fetch(batch=batch, wait_s=FETCH_WAIT_S)
                if messages and self._pull.pin != pinned_before:
                    try:
                        messages = await self._after_the_former_holder(messages)
                    except asyncio.CancelledError:  # stopped past its budget meanwhile: not left to the ack wait
                        await bus.hand_back(messages)
                        raise
            except nats.errors.Error as exc:  # reconnecting, or the stream's leader is being elected
                log.warning("fetching partition %s failed: %s", self.partition, exc)
                await asyncio.sleep(1.0)
                continue
            if not messages:
                continue
            self._held = [message for message in self._held if not message.is_acked] + messages
            if self._stopping:  # fetched while stopping: another replica (or the next start) takes them now
                await bus.hand_back(messages)
                return
            # Redelivered writes (a crashed replica's, or handed back) come in no particular order.
            messages.sort(key=lambda message: message.metadata.sequence.stream)
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

    async def _after_the_former_holder(self, messages: list[Msg]) -> list[Msg]:
        """The partition was just pinned here. If another replica still holds some of its writes (it lost the pin
        while deciding them: the consumer's leader changed on a cluster, it was cut off from NATS, an operator
        unpinned it), those are older than what was fetched: nothing is decided until they are acknowledged or come
        back here (then they join the batch, in order), or HOLD_OFF_ACK_WAITS ack waits have passed."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + HOLD_OFF_ACK_WAITS * self._ack_wait_s + bus.PIN_MARGIN_S
        held_here = sum(not message.is_acked for message in self._held)
        waited = False
        async with bus.kept_in_progress(messages, self._ack_wait_s):
            while not self._stopping and loop.time() < deadline:
                try:
                    elsewhere = await self._pull.unacknowledged() - held_here - len(messages)
                    if elsewhere <= 0:
                        break
                    if not waited:
                        log.info("partition %s: waiting for %s writes another replica holds", self.partition, elsewhere)
                        waited = True
                    messages += await self._pull.fetch(batch=self._batch, wait_s=HOLD_OFF_PULL_S)
                except nats.errors.Error as exc:
                    # Most likely while the consumer's leader changes, the very moment a pin moves: what was
                    # fetched stays in hand and the wait goes on (to its deadline); dropped, it would come back
                    # after the ack wait, behind later writes.
                    log.warning("partition %s: the former holder's writes cannot be counted now: %s", self.partition, exc)
                    await asyncio.sleep(HOLD_OFF_PULL_S)
        if waited:
            log.info("partition %s: deciding again after %.1f s", self.partition, loop.time() - started)
        return messages

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
