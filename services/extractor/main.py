"""The extractor: consumes `generations.completed.*` and turns each eligible turn into write events.

Every replica binds to one shared durable consumer (queue semantics), so replicas split the load and a
killed replica's event comes back after the ack wait. Each replica handles up to
MEMORIES_EXTRACTOR_CONCURRENCY turns at once, each fetched as a worker frees up (one slow turn holds up no
other): the LLM call is the slow part, and the writes it produces are serialised by the writer, not here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from datetime import datetime

from faststream.nats.annotations import NatsMessage
from nats.aio.client import Client as NatsClient
from pydantic import ValidationError

from shared import bus, metrics
from shared.consumer_process import ConsumerProcess
from shared.db.session import session_factory
from shared.events import ExtractionCompleted, GenerationCompleted
from shared.extraction import ExtractionResult, Extractor, WritesPending, WritesRefused
from shared.ids import EVENT_PREFIX, PROJECT_PREFIX, is_valid_id, new_id
from shared.llm import LlmError
from shared.logs import log_context
from shared.settings import Settings
from shared.write_gateway import WriteGateway

log = logging.getLogger("memories.extractor")
UNSETTLED = "a completed turn could not be settled"
"""Not settled, it comes back after the ack wait (FastStream logs nothing here: its logger is off)."""


QUEUED_WRITES_PATIENCE_S = 600.0
"""How long a turn waits in place for its facts to be decided (no writer running) before it is handed back and
counted towards MEMORIES_MAX_DELIVER: writers restarted or redeployed are back well within it."""


POOL_SIZE = 4
"""Database connections an extractor keeps: its turns mostly wait on their model, holding none (docs/operations.md
counts them, "Database connections")."""


class ExtractorService(ConsumerProcess):
    role = bus.Role.EXTRACTOR

    def __init__(self, settings: Settings, concurrency: int = 8) -> None:
        super().__init__(settings, pool_size=POOL_SIZE, graceful_timeout=30.0)
        self._extractor: Extractor | None = None
        self.subscribe(bus.EXTRACTOR_DURABLE, concurrency)(self.handle)

    async def prepare(self, nc: NatsClient) -> None:
        from shared.litellm_loader import load_litellm

        await asyncio.to_thread(load_litellm)  # seconds of imports: not on the first turn's clock
        sessions = session_factory(self.engine)
        gateway = WriteGateway(nc, sessions, self.settings.memories_partitions)
        await gateway.start()
        self._extractor = Extractor(
            sessions,
            gateway,
            llm_timeout=self.settings.memories_llm_timeout_s,
            write_timeout=self.settings.memories_write_timeout_s,
            service_model=self.settings.memories_merge_model,
            nameable_providers=self.settings.agent_model_providers,
        )

    def consumers(self) -> list[metrics.ConsumerRef]:
        return metrics.queue_consumers(self.settings)

    async def handle(self, message: NatsMessage) -> None:
        try:
            await self._handle(message)
        except Exception:
            # FastStream logs nothing here (its logger is off); not settled, the turn comes back after the ack wait.
            log.exception(UNSETTLED, extra={"subject": message.raw_message.subject})

    async def _handle(self, message: NatsMessage) -> None:
        assert self.nc is not None
        raw = message.raw_message
        js = self.nc.jetstream()
        try:
            event = GenerationCompleted.model_validate_json(message.body)
        except ValidationError as exc:
            await bus.dead_letter(js, "extractor", raw.subject, message.body, reason=f"invalid event: {exc.errors()[:3]}")
            await message.ack()
            return
        # The subject names the project: a platform allowed to publish on its own project's subject only must not
        # write into another project by naming it in the body (and an id that is none would fail every query).
        if raw.subject != bus.generation_completed_subject(event.project_id) or not is_valid_id(
            event.project_id, PROJECT_PREFIX
        ):
            reason = "invalid event: its project_id is not a project id, or not the one its subject names"
            await bus.dead_letter(js, "extractor", raw.subject, message.body, reason=reason)
            await message.ack()
            return
        # Every line logged for this turn names it, the write gateway's included, and a failure to settle it.
        with log_context(generation_id=event.generation_id, project_id=event.project_id):
            try:
                await self._handle_event(message, event)
            except Exception:
                log.exception(UNSETTLED, extra={"subject": raw.subject})

    async def _handle_event(self, message: NatsMessage, event: GenerationCompleted) -> None:
        assert self._extractor is not None
        metadata = message.raw_message.metadata
        try:
            # A slow model must not let the ack wait expire: that would hand the turn to another replica.
            async with bus.kept_in_progress([message.raw_message], self.settings.memories_ack_wait_s):
                result = await self.extract_through_outages(event, arrived_at=metadata.timestamp if metadata else None)
        except (LlmError, WritesPending, WritesRefused) as exc:
            await self._retry_or_give_up(message, event, str(exc))
            return
        except Exception as exc:
            # It would fail the same way on every delivery: retried as a model failure is, then dead-lettered,
            # not retried for ever (asking the model again each time).
            log.exception("extraction failed")
            await self._retry_or_give_up(message, event, f"the extraction failed unexpectedly ({type(exc).__name__})")
            return
        if not result.replayed:  # counted when first decided
            _count(result)
        await message.ack()
        await self._announce(event, result)

    async def extract_through_outages(self, event: GenerationCompleted, *, arrived_at: datetime | None) -> ExtractionResult:
        """The turn's extraction. An outage (the database, the bus, the embedder refusing writes, the writer not
        deciding its queued writes) is waited out in place, the message kept in progress: handed back, each
        delivery would count towards MEMORIES_MAX_DELIVER, and a turn held through an outage would be
        dead-lettered (its facts written later all the same, its status left failed)."""
        assert self._extractor is not None
        pause, refusals, queued_since = self.settings.memories_retry_backoff_s, 0, None
        # The turn's writes queued on the stream are waited for, not submitted again: a claim gone stale (30 s) is
        # published again, and past the stream's duplicate window stored again, a copy of each fact every ~40 s
        # while no writer decides them.
        queued: list[str] = []
        while True:
            try:
                if queued and not await self._extractor.decided(queued):
                    raise WritesPending(f"{len(queued)} writes still queued", queued)
                return await self._extractor.extract(event, arrived_at=arrived_at)
            except WritesPending as exc:
                # Queued on the stream: decided once a writer runs (or failed by it for good, an outcome too). A
                # partition no writer reads would hold the turn, and a replica's share of turns, for ever.
                queued_since = queued_since or time.monotonic()
                if time.monotonic() - queued_since > QUEUED_WRITES_PATIENCE_S:
                    raise
                queued = exc.write_ids
                log.warning("extraction waits for its queued writes: %s", exc)
            except WritesRefused:
                # Refused for now, or for good (a text the embedder always rejects looks the same): waited out a
                # while, then handed back and counted, like a model failure.
                refusals += 1
                if refusals > self.settings.memories_max_deliver:
                    raise
                log.warning("extraction waits for its refused facts (%s)", refusals)
            except Exception as exc:
                if not (bus.is_outage(exc) or isinstance(exc, bus.BusUnavailable)):
                    raise
                log.warning("extraction waits out an outage: %s", str(exc) or type(exc).__name__)
            await asyncio.sleep(pause)
            pause = min(pause * 2, bus.RETRY_DELAY_MAX_S)

    async def _retry_or_give_up(self, message: NatsMessage, event: GenerationCompleted, reason: str) -> None:
        assert self._extractor is not None and self.nc is not None
        raw = message.raw_message
        delivered = bus.deliveries(raw)
        if bus.retried(delivered, self.settings.memories_max_deliver):  # its outages were waited out already
            log.warning("extraction will be retried (%s): %s", delivered, reason)
            await message.nack(delay=bus.retry_delay(self.settings.memories_retry_backoff_s, delivered))
            return
        result = await self._extractor.record_failure(event, reason)
        if result.replayed:  # another delivery extracted the turn meanwhile: that outcome stands, nothing failed
            await message.ack()
            await self._announce(event, result)
            return
        _count(result)
        await bus.dead_letter(self.nc.jetstream(), "extractor", raw.subject, message.body, reason=reason)
        await message.ack()
        await self._announce(event, result)

    async def _announce(self, event: GenerationCompleted, result: ExtractionResult) -> None:
        """For the platform to record on its generation; best-effort, the outcome is stored already."""
        assert self.nc is not None
        notice = ExtractionCompleted(
            event_id=new_id(EVENT_PREFIX),
            project_id=event.project_id,
            generation_id=event.generation_id,
            status=result.status,
            reason=result.reason,
            summary=result.summary,
        )
        try:
            await self.nc.jetstream().publish(
                bus.extraction_completed_subject(event.project_id),
                notice.model_dump_json().encode(),
                stream=bus.GENERATIONS_STREAM,
                headers={"Nats-Msg-Id": _notice_id(event, result)},
            )
        except Exception:
            log.exception("could not publish the extraction summary")


def _notice_id(event: GenerationCompleted, result: ExtractionResult) -> str:
    """A turn delivered again once decided (a lost ack) is announced again under the same id: the stream keeps one
    notice per outcome, within its duplicate window. A failure is an outcome of one report (its event): a retry
    that fails too is announced as well."""
    notice = f"extraction:{event.project_id}:{event.generation_id}:{result.status}"
    return f"{notice}:{event.event_id}" if result.status == "failed" else notice


def _count(result: ExtractionResult) -> None:
    metrics.observe_extraction(result.status)
    if result.status == "skipped":
        metrics.observe_extraction_skip(result.reason)
    log.info("extraction %s", result.status, extra={"reason": result.reason, "model": result.model})


async def run(settings: Settings) -> int:
    """`memories extractor`: run until SIGINT/SIGTERM; its exit status."""
    if not settings.memories_merge_model:
        log.warning(
            "no service model (MEMORIES_MERGE_MODEL): only agents with a provider, route or model extract"
        )
    return await ExtractorService(settings, concurrency=settings.memories_extractor_concurrency).run_until_signalled()
