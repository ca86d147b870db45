"""Deleted generations and conversations: entries forget the reference, the facts stay."""

from __future__ import annotations

import logging

from faststream.nats.message import NatsMessage
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared import repository as repo
from shared.events import ConversationDeleted, GenerationDeleted

log = logging.getLogger("memories.writer")


class ProvenanceHandler:
    def __init__(self, sessions: async_sessionmaker[AsyncSession], dead_letter) -> None:
        self._sessions = sessions
        self._dead_letter = dead_letter

    async def handle(self, message: NatsMessage) -> None:
        subject = message.raw_message.subject
        try:
            if subject.startswith("generations."):
                event: GenerationDeleted | ConversationDeleted = GenerationDeleted.model_validate_json(message.body)
            else:
                event = ConversationDeleted.model_validate_json(message.body)
        except ValidationError as exc:
            await self._dead_letter(subject, message.body, reason=f"invalid deletion event: {exc.errors()[:3]}")
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
        except Exception:
            log.exception("could not clear provenance for %s", subject)
            await message.nack(delay=1.0)
            return
        await message.ack()
        log.info("provenance cleared on %d entries", cleared, extra={"subject": subject})
