"""Deleted generations and conversations: entries forget the reference, the facts stay."""

from __future__ import annotations

import logging

from faststream.nats.message import NatsMessage
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import bus
from shared import repository as repo
from shared.events import ConversationDeleted, GenerationDeleted
from shared.ids import PROJECT_PREFIX, is_valid_id
from shared.settings import Settings

log = logging.getLogger("memories.writer")


class ProvenanceHandler:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], dead_letter, settings: Settings) -> None:
        self._sessions = sessions
        self._dead_letter = dead_letter
        self._max_deliver = settings.memories_max_deliver
        self._backoff = settings.memories_retry_backoff_s

    async def handle(self, message: NatsMessage) -> None:
        subject = message.raw_message.subject
        try:
            if subject.startswith(f"{bus.GENERATION_DELETED_ROOT}."):
                event: GenerationDeleted | ConversationDeleted = GenerationDeleted.model_validate_json(message.body)
            else:
                event = ConversationDeleted.model_validate_json(message.body)
        except ValidationError as exc:
            await self._dead_letter(subject, message.body, reason=f"invalid deletion event: {exc.errors()[:3]}")
            await message.ack()
            return
        # The subject names the project: a platform allowed to publish on its own project's subjects only must not
        # clear another project's references by naming it in the body.
        named = bus.generation_deleted_subject if isinstance(event, GenerationDeleted) else bus.conversation_deleted_subject
        if subject != named(event.project_id) or not is_valid_id(event.project_id, PROJECT_PREFIX):
            reason = "invalid deletion event: its project_id is not a project id, or not the one its subject names"
            await self._dead_letter(subject, message.body, reason=reason)
            await message.ack()
            return
        # Its time says whether it was applied already (a redelivery must not clear newer citations): the platform's,
        # never later than the stream's (the same on every redelivery), should the platform's clock run ahead.
        stored = message.raw_message.metadata.timestamp if message.raw_message.metadata else None
        deleted_at = min(event.occurred_at, stored) if stored is not None else event.occurred_at
        try:
            async with self._sessions.begin() as session:
                if isinstance(event, GenerationDeleted):
                    cleared = await repo.clear_provenance(
                        session, event.project_id, generation_id=event.generation_id, deleted_at=deleted_at
                    )
                else:
                    cleared = await repo.clear_provenance(
                        session, event.project_id, conversation_id=event.conversation_id, deleted_at=deleted_at
                    )
        except Exception as exc:
            delivered = bus.deliveries(message.raw_message)
            if bus.retried(delivered, self._max_deliver, exc):
                log.warning("could not clear provenance for %s, will retry", subject, exc_info=exc)
                await message.nack(delay=bus.retry_delay(self._backoff, delivered))
                return
            log.error("could not clear provenance for %s, giving up", subject, exc_info=exc)
            await self._dead_letter(subject, message.body, reason=f"gave up after {delivered}: {exc!r}")
            await message.ack()
            return
        await message.ack()
        log.info("provenance cleared on %d entries", cleared, extra={"subject": subject})
