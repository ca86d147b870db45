"""The extractor: consumes `generation.completed` and turns each eligible turn into write events.

Every replica binds to one shared durable consumer (queue semantics), so replicas split the load and a
killed replica's event comes back after the ack wait. A fetched batch runs concurrently: the LLM call
is the slow part, and the writes it produces are serialised by the writer, not here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from faststream.middlewares import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from nats.aio.client import Client as NatsClient
from pydantic import ValidationError

from shared import bus, metrics
from shared.db.session import create_engine, session_factory
from shared.events import ExtractionCompleted, GenerationCompleted
from shared.extraction import ExtractionResult, Extractor, WritesPending
from shared.ids import new_id
from shared.lifecycle import wait_for_shutdown_signal
from shared.llm import LlmError
from shared.logs import log_context
from shared.settings import Settings
from shared.write_gateway import WriteGateway

log = logging.getLogger("memories.extractor")


class ExtractorService:
    def __init__(self, settings: Settings, concurrency: int = 8) -> None:
        assert settings.database_url and settings.nats_url
        self.settings = settings
        self.broker = NatsBroker(settings.nats_url.split(","), graceful_timeout=30.0, logger=None)
        self._engine = create_engine(settings.database_url, pool_size=4)
        self._nc: NatsClient | None = None
        self._extractor: Extractor | None = None
        self._metrics_server: metrics.MetricsServer | None = None
        self._lag_poller: asyncio.Task[None] | None = None

        @self.broker.subscriber(
            f"{bus.GENERATION_COMPLETED_ROOT}.*",
            stream=JStream(bus.GENERATIONS_STREAM, declare=False),
            durable=bus.EXTRACTOR_DURABLE,
            pull_sub=PullSub(batch_size=concurrency, timeout=1.0),
            ack_policy=AckPolicy.MANUAL,
            no_reply=True,
        )
        async def handle_generation(message: NatsMessage) -> None:
            await self.handle(message)

    async def start(self) -> None:
        if self.settings.memories_scripted_llm:
            from shared.scripted_llm import install_scripts  # tests and benchmarks only

            install_scripts(self.settings.memories_scripted_llm)
        from shared.litellm_loader import load_litellm

        await asyncio.to_thread(load_litellm)  # seconds of imports: not on the first turn's clock
        self._nc = await bus.connect(self.settings.nats_url or "", name="memories-extractor")
        await bus.ensure_layout(self._nc.jetstream(), self.settings)
        sessions = session_factory(self._engine)
        gateway = WriteGateway(self._nc, sessions, self.settings.memories_partitions)
        await gateway.start()
        self._extractor = Extractor(
            sessions,
            gateway,
            llm_timeout=self.settings.memories_llm_timeout_s,
            write_timeout=self.settings.memories_write_timeout_s,
            service_model=self.settings.memories_merge_model,
        )
        await self.broker.start()
        self._lag_poller = asyncio.create_task(
            metrics.run_lag_poller(self._nc.jetstream(), metrics.queue_consumers(self.settings)),
            name="extractor-lag-poller",
        )
        self._metrics_server = await metrics.serve_metrics(self.settings, ready=self.is_ready)

    def is_ready(self) -> bool:
        """`/readyz`: consuming, and the bus connection is up (a reconnecting client fetches nothing)."""
        return self._extractor is not None and self._nc is not None and self._nc.is_connected

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

    async def handle(self, message: NatsMessage) -> None:
        assert self._nc is not None
        raw = message.raw_message
        js = self._nc.jetstream()
        try:
            event = GenerationCompleted.model_validate_json(message.body)
        except ValidationError as exc:
            await bus.dead_letter(js, "extractor", raw.subject, message.body, reason=f"invalid event: {exc.errors()[:3]}")
            await message.ack()
            return
        # Every line logged for this turn names it, the write gateway's included.
        with log_context(generation_id=event.generation_id, project_id=event.project_id):
            await self._handle_event(message, event)

    async def _handle_event(self, message: NatsMessage, event: GenerationCompleted) -> None:
        assert self._extractor is not None
        heartbeat = asyncio.create_task(self._keep_in_progress(message))
        try:
            result = await self._extractor.extract(event)
        except (LlmError, WritesPending) as exc:
            await self._retry_or_give_up(message, event, str(exc))
            return
        except Exception:  # noqa: BLE001 - database or bus trouble: let JetStream redeliver
            log.exception("extraction failed")
            await message.nack(delay=2.0)
            return
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat
        _count(result)
        await message.ack()
        await self._announce(event, result)

    async def _keep_in_progress(self, message: NatsMessage) -> None:
        """A slow model must not let the ack wait expire: that would hand the turn to another replica."""
        while True:
            await asyncio.sleep(self.settings.memories_ack_wait_s / 3)
            await message.in_progress()

    async def _retry_or_give_up(self, message: NatsMessage, event: GenerationCompleted, reason: str) -> None:
        assert self._extractor is not None and self._nc is not None
        raw = message.raw_message
        delivered = raw.metadata.num_delivered if raw.metadata else 1
        if delivered < self.settings.memories_max_deliver:
            log.warning("extraction will be retried (%s): %s", delivered, reason)
            await message.nack(delay=min(self.settings.memories_retry_backoff_s * 2**delivered, 30.0))
            return
        result = await self._extractor.record_failure(event, reason)
        _count(result)
        await bus.dead_letter(self._nc.jetstream(), "extractor", raw.subject, message.body, reason=reason)
        await message.ack()
        await self._announce(event, result)

    async def _announce(self, event: GenerationCompleted, result: ExtractionResult) -> None:
        """For the platform to record on its generation; best-effort, the outcome is stored already."""
        assert self._nc is not None
        notice = ExtractionCompleted(
            event_id=new_id("evt_"),
            project_id=event.project_id,
            generation_id=event.generation_id,
            status=result.status,
            reason=result.reason,
            summary=result.summary,
        )
        try:
            await self._nc.jetstream().publish(
                f"generations.extraction.{event.project_id}",
                notice.model_dump_json().encode(),
                stream=bus.GENERATIONS_STREAM,
            )
        except Exception:  # noqa: BLE001
            log.exception("could not publish the extraction summary")


def _count(result: ExtractionResult) -> None:
    metrics.observe_extraction(result.status)
    if result.status == "skipped":
        metrics.observe_extraction_skip(result.reason)
    log.info("extraction %s", result.status, extra={"reason": result.reason, "model": result.model})


async def run(settings: Settings) -> None:
    """`memories extractor`: run until SIGINT/SIGTERM."""
    if not settings.memories_merge_model:
        log.warning(
            "no service model (MEMORIES_MERGE_MODEL): only agents with a provider, route or model extract"
        )
    service = ExtractorService(settings, concurrency=settings.memories_extractor_concurrency)
    await service.start()
    try:
        await wait_for_shutdown_signal()
    finally:
        await service.stop()
