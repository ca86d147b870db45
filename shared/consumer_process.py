"""What every bus-consuming process has in common (writer, extractor): the connections, the JetStream
layout, the metrics server and the lag poller, and an orderly stop. Subclasses register their FastStream
subscribers in `__init__` and build their handlers in `prepare()`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.security import NatsSecurity, NatsUserPassword
from nats.aio.client import Client as NatsClient
from sqlalchemy.ext.asyncio import AsyncEngine

from shared import bus, bus_connection, metrics
from shared.db.migrate import wait_for_schema
from shared.db.session import create_engine
from shared.lifecycle import freeze_long_lived_objects, wait_for_shutdown_signal
from shared.metrics_server import MetricsServer, serve_metrics
from shared.settings import Settings

log = logging.getLogger("memories.service")


def exit_at_once() -> None:
    logging.shutdown()
    os._exit(1)


class ConsumerProcess:
    role: bus.Role

    def __init__(self, settings: Settings, *, pool_size: int, graceful_timeout: float) -> None:
        assert settings.database_url and settings.nats_url, "resolve the servers before starting a service"
        self.settings = settings
        metrics.reserve_model_labels(settings.embedding_model, settings.memories_merge_model)
        login = bus_connection.login(settings)
        options = bus_connection.connection_options(settings, name=f"memories-{self.role}-consumers")
        # FastStream takes the login and the TLS arguments as one security object, not as nats-py's arguments.
        tls_options = bus_connection.tls_options(settings)
        tls = {"ssl_context": tls_options.get("tls"), "tls_handshake_first": tls_options.get("tls_handshake_first", False)}
        security = (
            NatsUserPassword(login["user"], login["password"], **tls) if login
            else NatsSecurity(**tls) if any(tls.values()) else None
        )
        self.broker = NatsBroker(
            settings.nats_url.split(","),
            graceful_timeout=graceful_timeout,
            logger=None,
            security=security,
            closed_cb=self._consumers_closed,
            **options,
        )
        # FastStream's subscribers take the default inbox prefix, not the connection's: the messages they pull come
        # on the user's own inboxes only if told.
        self._subscriber_inboxes = {"inbox_prefix": f"{options['inbox_prefix']}.".encode()} if "inbox_prefix" in options else {}
        self._stopping = False
        # A failed message is redelivered anyway: no pre-ping round trip on every checkout.
        self.engine: AsyncEngine = create_engine(settings.database_url, pool_size=pool_size, pre_ping=False)
        self.nc: NatsClient | None = None
        self._ready = False
        self._metrics_server: MetricsServer | None = None
        self._lag_poller: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()  # set by SIGINT or SIGTERM, or by `fail`
        self._failure: str | None = None

    def subscribe(self, durable: str, workers: int):  # type: ignore[no-untyped-def]
        """A pull subscriber bound to a durable consumer of this process's role: the layout is ours (shared.bus),
        so FastStream declares nothing and a changed setting is applied by `ensure_layout`, not ignored.

        One message a fetch, handled by the first of `workers` free (one: in order). A fetched batch would be
        handled together and the next fetched only once all of it is done: one slow message (a turn waiting for
        its writes) held up the other workers' messages for as long. While every worker is busy, one message waits
        fetched for the next free one, not yet kept in progress: past the ack wait JetStream hands it to another
        replica, and this one's later attempt finds it done (or asks its model again: the first facts saved are the
        ones written); a stop leaves it to the ack wait."""
        consumer = bus.layout(self.settings).consumer(durable)
        if consumer.owner != self.role:  # its NATS user could not pull from it either (shared.bus_permissions)
            raise ValueError(f"{durable} is consumed by the {consumer.owner}, which alone may pull from it")
        return self.broker.subscriber(
            consumer.subject,
            stream=JStream(consumer.stream, declare=False),
            durable=durable,
            pull_sub=PullSub(batch_size=1, timeout=1.0),
            max_workers=workers,
            ack_policy=AckPolicy.MANUAL,
            no_reply=True,
            **self._subscriber_inboxes,
        )

    async def prepare(self, nc: NatsClient) -> None:
        """Build the handlers (connections are up, the layout applied, the broker not yet consuming)."""

    def consumers(self) -> list[metrics.ConsumerRef]:
        """The durable consumers whose lag this process reports."""
        return []

    async def start(self) -> None:
        if self.settings.memories_scripted_llm:
            from shared.scripted_llm import install_scripts  # tests and benchmarks only

            install_scripts(self.settings.memories_scripted_llm)
        # Answering first (/healthz alive, /readyz not yet): a start that waits out an outage of the bus or a
        # migration still running is alive, and a startup probe must not restart it for that.
        self._metrics_server = await serve_metrics(self.settings, ready=self.is_ready)
        self.nc = await bus_connection.connect(self.settings.nats_url or "", name=f"memories-{self.role}", settings=self.settings)
        # The bus first: a service configured unlike it (another partition count) says so at once, whatever the
        # database's state.
        await bus.ensure_layout(self.nc.jetstream(), self.settings, self.role)
        await wait_for_schema(self.engine)
        await self.prepare(self.nc)
        freeze_long_lived_objects()
        await self.broker.start()
        self._ready = True
        self._lag_poller = asyncio.create_task(
            metrics.run_lag_poller(self.nc.jetstream(), self.consumers()), name=f"{self.role}-lag-poller"
        )

    def is_ready(self) -> bool:
        """`/readyz`: consuming, and the bus connection is up (a reconnecting client fetches nothing)."""
        return self._ready and self._failure is None and self.nc is not None and self.nc.is_connected

    def fail(self, reason: str) -> None:
        """A part of the process stopped for good (a bug): the process stops as on SIGTERM and exits with status 1,
        for its supervisor to start it again. Left running, it would look ready and do less than its share."""
        if self._failure is None:
            log.critical("%s stopping: %s", self.role, reason)
            self._failure = reason
        self._stop.set()

    async def _consumers_closed(self) -> None:
        """FastStream's pull loop fetches again at once when a fetch fails on a closed connection, never yielding to
        the event loop: on a connection the server closed for good (a login revoked) the process would spin at full
        CPU, deaf to SIGTERM. Such a close ends it at once; what it held is delivered again after the ack wait."""
        if not self._stopping:
            log.critical("%s: the consumers' NATS connection was closed for good: exiting", self.role)
            exit_at_once()

    async def stop(self) -> None:
        self._stopping = True
        if self._lag_poller is not None:
            self._lag_poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_poller
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        await self.broker.stop()
        if self.nc is not None and not self.nc.is_closed:  # closed for good by the server: nothing to drain
            await self.nc.drain()
        await self.engine.dispose()

    async def run_until_signalled(self) -> int:
        """`memories writer|extractor`: run until SIGINT/SIGTERM (or `fail`), then finish the messages in hand. The
        process's exit status: 1 after `fail`."""
        try:
            await self.start()
        except BaseException:
            # Stop what did start (consumers, the lag poller): left running, their tasks would keep the process
            # from exiting, and a restart policy would never see the failure.
            with contextlib.suppress(Exception):
                await self.stop()
            raise
        try:
            await wait_for_shutdown_signal(self._stop)
        finally:
            await self.stop()
        return 0 if self._failure is None else 1
