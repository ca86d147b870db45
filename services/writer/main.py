"""The writer: consumes MEMORY_WRITES, one durable pull consumer per partition, and decides each write.

Any number of replicas may run: each pulls every partition's durable consumer (or the partitions it is given),
JetStream serves each partition to one replica at a time (the others wait their turn), and that replica decides
the partition's queued writes as one batch, in order, while it prepares the next (services.writer.partitions); a
memory whose write waits on a model is decided aside (services.writer.handler). `max_ack_pending` on those
consumers is two batches; the database lock keeps the decisions on a memory serial whatever happens, and the
write-outcome table makes redeliveries harmless."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from faststream.nats.annotations import NatsMessage
from nats.aio.client import Client as NatsClient

from services.writer.handler import WriteHandler
from services.writer.partitions import PartitionConsumer
from services.writer.provenance import ProvenanceHandler
from shared import bus, metrics
from shared.batching import Coalescer
from shared.consumer_process import ConsumerProcess
from shared.db.session import check_embedding_dimensions, session_factory
from shared.embeddings import embed_texts, preload
from shared.settings import Settings
from shared.writes import WriteApplier

log = logging.getLogger("memories.writer")

STOP_BUDGET_S = 10.0
"""How long a stopping writer finishes what it holds (batches in hand, writes set aside); the rest is redelivered."""

class Writer(ConsumerProcess):
    """One writer replica; `start`/`stop` also let tests run replicas in-process."""

    role = bus.Role.WRITER

    def __init__(self, settings: Settings, partitions: Sequence[int] | None = None) -> None:
        self.partitions = list(partitions) if partitions is not None else list(range(settings.memories_partitions))
        # A memory whose write waits on a model holds a connection meanwhile, and so many memories may
        # (services.writer.handler's lanes); the shared transaction, the copies' query and the deletion
        # consumers take a few more, within the pool's overflow.
        self._model_lanes = min(len(self.partitions), 32)
        super().__init__(settings, pool_size=self._model_lanes + 2, graceful_timeout=STOP_BUDGET_S)
        self._handler: WriteHandler | None = None
        self._provenance: ProvenanceHandler | None = None
        self._partition_consumers: list[PartitionConsumer] = []
        # Beside its partitions (pulled by PartitionConsumer), the consumers every writer replica shares: deletions.
        owned = bus.layout(settings).consumers_of(self.role)
        self._deletion_consumers = [consumer for consumer in owned if consumer.stream != bus.WRITES_STREAM]
        for consumer in self._deletion_consumers:
            self.subscribe(consumer.durable, workers=1)(self._handle_deletion)

    async def _handle_deletion(self, message: NatsMessage) -> None:
        assert self._provenance is not None
        await self._provenance.handle(message)

    async def prepare(self, nc: NatsClient) -> None:
        model = self.settings.embedding_model
        dimensions = self.settings.embedding_dimensions
        await check_embedding_dimensions(self.engine, dimensions)

        async def embed_batch(texts: list[str]) -> list[list[float]]:
            return await embed_texts(texts, model=model, dimensions=dimensions, purpose=metrics.Purpose.WRITE)

        applier = WriteApplier(
            session_factory(self.engine),
            Coalescer(embed_batch),
            model,
            default_model=self.settings.memories_merge_model,
            llm_timeout=self.settings.memories_llm_timeout_s,
        )
        # litellm's imports and the model's load off the event loop (seconds, on which /healthz would wait), then a
        # first run before the first write waits on it.
        await asyncio.to_thread(preload, model)
        await embed_batch(["warm up"])
        self._handler = WriteHandler(applier, nc, self.settings, model_lanes=self._model_lanes)
        self._provenance = ProvenanceHandler(session_factory(self.engine), self._handler.dead_letter, self.settings)

    async def start(self) -> None:
        await super().start()
        assert self.nc is not None and self._handler is not None
        self._partition_consumers = [
            PartitionConsumer(
                self.nc,
                partition,
                self._handler.prepare,
                self._handler.finish,
                batch=self.settings.memories_write_batch,
                ack_wait_s=self.settings.memories_ack_wait_s,
                on_failure=self.fail,
            )
            for partition in self.partitions
        ]
        for consumer in self._partition_consumers:
            consumer.start()
        log.info("writer consuming partitions %s", _ranges(self.partitions))

    async def stop(self) -> None:
        if self._handler is not None:
            self._handler.stop()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + STOP_BUDGET_S
        await asyncio.gather(*(consumer.stop(timeout=STOP_BUDGET_S) for consumer in self._partition_consumers))
        if self._handler is not None:
            await self._handler.finish_lanes(timeout=deadline - loop.time())
        await asyncio.gather(*(consumer.release() for consumer in self._partition_consumers))
        await super().stop()

    def consumers(self) -> list[metrics.ConsumerRef]:
        """Its partitions and the deletions, so their lag shows while this replica runs."""
        deletions = [(consumer.stream, consumer.durable) for consumer in self._deletion_consumers]
        return metrics.writer_consumers(self.settings, self.partitions) + deletions


def _ranges(partitions: Sequence[int]) -> str:
    """`0-7,12,14-15`: as `--partitions` takes them (a run of consecutive partitions as one range)."""
    runs: list[list[int]] = []
    for partition in sorted(partitions):
        if runs and partition == runs[-1][-1] + 1:
            runs[-1].append(partition)
        else:
            runs.append([partition])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs) or "none"


async def run(settings: Settings, partitions: Sequence[int] | None = None) -> int:
    """`memories writer`; its exit status."""
    return await Writer(settings, partitions).run_until_signalled()
