"""The writer: consumes MEMORY_WRITES, one durable pull consumer per partition, and decides each write.

Any number of replicas may run: each binds to every partition's durable consumer (or to the partitions it
is given), and `max_ack_pending=1` on those consumers lets only one write per partition be in flight across
all of them. The database lock and the write-outcome table make redeliveries harmless.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from nats.aio.client import Client as NatsClient

from services.writer.handler import WriteHandler
from services.writer.provenance import ProvenanceHandler
from shared import bus, metrics
from shared.batching import BatchingEmbedder
from shared.db.session import create_engine, session_factory
from shared.embeddings import embed_texts
from shared.lifecycle import wait_for_shutdown_signal
from shared.settings import Settings
from shared.writes import WriteApplier

log = logging.getLogger("memories.writer")

_DELETIONS = (
    (bus.WRITER_GENERATION_DELETIONS, f"{bus.GENERATION_DELETED_ROOT}.*"),
    (bus.WRITER_CONVERSATION_DELETIONS, f"{bus.CONVERSATION_DELETED_ROOT}.*"),
)
"""(durable, subject) of the deletion consumers every writer replica shares with the others."""


class Writer:
    """Owns the writer's connections; `start`/`stop` let tests run replicas in-process."""

    def __init__(self, settings: Settings, partitions: Sequence[int] | None = None) -> None:
        assert settings.database_url and settings.nats_url
        self.settings = settings
        self.partitions = list(partitions) if partitions is not None else list(range(settings.memories_partitions))
        self.broker = NatsBroker(settings.nats_url.split(","), graceful_timeout=10.0, logger=None)
        self._engine = create_engine(settings.database_url, pool_size=8, pre_ping=False)
        self._nc: NatsClient | None = None
        self._handler: WriteHandler | None = None
        self._provenance: ProvenanceHandler | None = None
        self._metrics_server: metrics.MetricsServer | None = None
        self._lag_poller: asyncio.Task[None] | None = None
        for partition in self.partitions:
            self._subscribe(partition)
        for durable, subject in _DELETIONS:
            self._subscribe_deletions(durable, subject)

    def _subscribe(self, partition: int) -> None:
        @self.broker.subscriber(
            bus.partition_filter(partition),
            # The layout is ours (shared.bus); FastStream only binds to the existing stream and consumer.
            stream=JStream(bus.WRITES_STREAM, declare=False),
            durable=bus.writer_durable(partition),
            pull_sub=PullSub(batch_size=1, timeout=1.0),
            ack_policy=AckPolicy.MANUAL,
            no_reply=True,
        )
        async def handle_write(message: NatsMessage) -> None:
            assert self._handler is not None
            await self._handler.handle(message)

    def _subscribe_deletions(self, durable: str, subject: str) -> None:
        @self.broker.subscriber(
            subject,
            stream=JStream(bus.GENERATIONS_STREAM, declare=False),
            durable=durable,
            pull_sub=PullSub(batch_size=1, timeout=1.0),
            ack_policy=AckPolicy.MANUAL,
            no_reply=True,
        )
        async def handle_deletion(message: NatsMessage) -> None:
            assert self._provenance is not None
            await self._provenance.handle(message)

    async def start(self) -> None:
        if self.settings.memories_scripted_llm:
            from shared.scripted_llm import install_scripts  # tests and benchmarks only

            install_scripts(self.settings.memories_scripted_llm)
        self._nc = await bus.connect(self.settings.nats_url or "", name="memories-writer")
        await bus.ensure_layout(self._nc.jetstream(), self.settings)
        model = self.settings.embedding_model
        dimensions = self.settings.embedding_dimensions

        async def embed_batch(texts: list[str]) -> list[list[float]]:
            return await embed_texts(texts, model=model, dimensions=dimensions, purpose=metrics.Purpose.WRITE)

        applier = WriteApplier(
            session_factory(self._engine),
            BatchingEmbedder(embed_batch),
            model,
            default_model=self.settings.memories_merge_model,
            llm_timeout=self.settings.memories_llm_timeout_s,
        )
        await embed_batch(["warm up"])  # loads litellm and the model before the first write waits on them
        self._handler = WriteHandler(applier, self._nc, self.settings)
        self._provenance = ProvenanceHandler(session_factory(self._engine), self._handler.dead_letter)
        await self.broker.start()
        self._lag_poller = asyncio.create_task(
            metrics.run_lag_poller(self._nc.jetstream(), self._consumers()), name="writer-lag-poller"
        )
        self._metrics_server = await metrics.serve_metrics(self.settings, ready=self.is_ready)
        log.info("writer consuming partitions %s", _ranges(self.partitions))

    def _consumers(self) -> list[metrics.ConsumerRef]:
        """What this replica consumes, so its lag shows while it runs: its partitions and the deletions."""
        deletions = [(bus.GENERATIONS_STREAM, durable) for durable, _ in _DELETIONS]
        return metrics.writer_consumers(self.settings, self.partitions) + deletions

    def is_ready(self) -> bool:
        """`/readyz`: consuming, and the bus connection is up (a reconnecting client fetches nothing)."""
        return self._handler is not None and self._nc is not None and self._nc.is_connected

    async def stop(self) -> None:
        if self._lag_poller is not None:
            self._lag_poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lag_poller
        if self._metrics_server is not None:
            await self._metrics_server.stop()
        await self.broker.stop()
        if self._nc is not None:
            await self._nc.drain()
        await self._engine.dispose()


def _ranges(partitions: Sequence[int]) -> str:
    return ",".join(str(p) for p in partitions) if len(partitions) < 8 else f"{partitions[0]}..{partitions[-1]}"


async def run(settings: Settings, partitions: Sequence[int] | None = None) -> None:
    """`memories writer`: run until SIGINT/SIGTERM, then finish the message in hand and stop."""
    writer = Writer(settings, partitions)
    await writer.start()
    try:
        await wait_for_shutdown_signal()
    finally:
        await writer.stop()
