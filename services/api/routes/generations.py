"""Completed generations for platforms that only speak HTTP, and the extraction outcome of each."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request, status
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, StrictBool, ValidationError, field_validator

from services.api.deps import PrincipalDep, ReadSessionDep, SessionDep, require, resolve_project
from services.api.errors import ApiError, not_found
from services.api.routing import CheckedRoute
from services.api.schemas import Strict, Timestamp
from shared import bus, registry
from shared.agents import KnowledgeConfig
from shared.events import (
    ChatMessage,
    ConversationId,
    ExtractionSummary,
    GenerationAgent,
    GenerationCompleted,
    GenerationId,
    UtcDatetime,
    refuse_nul,
    utcnow,
)
from shared.ids import EVENT_PREFIX, new_id

router = APIRouter(prefix="/generations", tags=["extraction"], route_class=CheckedRoute)


class CompletedTurn(Strict):
    project_id: str | None = None
    generation_id: GenerationId
    conversation_id: ConversationId | None = None
    agent: GenerationAgent
    extract: StrictBool | None = None
    streamed: StrictBool = Field(
        default=False, description="a streamed turn is never extracted, whatever `extract` says (skipped: streamed)"
    )
    status: str = Field(
        default="completed", max_length=64,
        description="completed, requires_action, failed, … (any case); only completed is extracted (else skipped: "
        "status_<status>)",
    )
    messages: list[ChatMessage] = Field(default_factory=list, max_length=500)
    output: str | None = Field(default=None, max_length=100_000)
    occurred_at: UtcDatetime | None = Field(
        default=None,
        description="when the turn ended (default: when it is first reported; never later than that). A forgetting "
        "of its generation or conversation made after this time does not apply to its facts",
    )

    # Refused here like everywhere in the API, though a transcript is only read (a model's NUL is dropped).
    @field_validator("status", "output")
    @classmethod
    def _no_nul(cls, value: str | None) -> str | None:
        return refuse_nul(value) if value is not None else None

    @field_validator("messages", mode="before")
    @classmethod
    def _text_parts_hold_text(cls, messages: Any) -> Any:
        # A part with a text that is none was read as a part without one (the turn then said nothing): a client's
        # slip, told here. On the bus such a part is passed over, as a platform's serialiser may write `"text": null`.
        for message in messages if isinstance(messages, list) else []:
            parts = message.get("content") if isinstance(message, dict) else None
            if isinstance(parts, list) and any(
                isinstance(part, dict) and "text" in part and not isinstance(part["text"], str) for part in parts
            ):
                raise ValueError("a content part's text must be a string")
        return messages

    @field_validator("messages")
    @classmethod
    def _no_nul_in_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        for message in messages:
            refuse_nul(message.role)
            refuse_nul(message.content or "")
        return messages


class TurnReported(BaseModel):
    generation_id: str
    status: Literal["pending", "completed", "skipped"]


class ExtractionStatus(BaseModel):
    generation_id: str
    status: str = Field(description="pending, completed, skipped or failed")
    reason: str | None
    summary: ExtractionSummary
    model: str | None
    updated_at: Timestamp


@router.post(
    "/completed",
    status_code=status.HTTP_202_ACCEPTED,
    summary="Publish generation.completed for extraction (the same event a platform on the bus publishes)",
    responses={
        200: {"description": "the turn was extracted already (`completed` or `skipped`): not again",
              "model": TurnReported},
        202: {"description": "published: the extraction is `pending`", "model": TurnReported},
    },
    dependencies=[require("memories:CreateMemoryEntry")],
)
async def generation_completed(
    body: CompletedTurn, request: Request, session: SessionDep, principal: PrincipalDep
) -> JSONResponse:
    _check_knowledge_config(body.agent.knowledge_config)
    project_id = await resolve_project(session, principal, body.project_id)
    reported = await registry.mark_extraction_pending(session, project_id, body.generation_id)
    await session.commit()
    # The turn's time: reported again (a retry after a failure), it is no newer than when first reported, so a
    # forgetting made in between still applies to its facts.
    times = [t for t in (body.occurred_at, reported.first_reported_at) if t is not None]
    event = GenerationCompleted(
        event_id=new_id(EVENT_PREFIX),
        project_id=project_id,
        occurred_at=min([*times, utcnow()]),
        **body.model_dump(exclude={"project_id", "occurred_at"}),
    )
    if reported.status in registry.EXTRACTED:  # extracted already: not twice, and not pending either
        return JSONResponse({"generation_id": event.generation_id, "status": reported.status}, status_code=200)
    retry_of = reported.retry_of
    # One turn is extracted once, however often the platform reports it; reported again after its extraction
    # failed, it is a retry, which the stream's duplicate window must not swallow.
    message_id = f"generation:{project_id}:{event.generation_id}"
    if retry_of is not None:
        message_id += f":retry-of:{retry_of}"
    try:
        await bus.publish_or_refuse(
            request.app.state.nats,
            bus.generation_completed_subject(project_id),
            event.model_dump_json().encode(),
            stream=bus.GENERATIONS_STREAM,
            msg_id=message_id,
        )
    except bus.BusUnavailable as exc:
        if not reported.reported_before:  # a turn reported again while pending has its first event on the bus
            await registry.fail_unpublished_extraction(session, project_id, event.generation_id)
            await session.commit()
        raise ApiError(503, f"the message bus is unavailable; retry ({exc})") from exc
    return JSONResponse({"generation_id": event.generation_id, "status": "pending"}, status_code=202)


def _check_knowledge_config(raw: dict[str, Any] | None) -> None:
    """Refused here as on the tool route, rather than published and skipped by the extractor later (a config
    on the bus that does not validate can only be skipped)."""
    try:
        KnowledgeConfig.parse(raw)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", "agent", "knowledge_config", *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from exc


@router.get(
    "/{generation_id:path}/extraction",  # `:path`: an id may hold a "/" (e.g. run/42)
    summary="The extraction outcome of a generation: {candidates, created, updated, skipped, failed}",
    dependencies=[require("memories:ListMemoryEntries")],
)
async def extraction_status(
    generation_id: str, session: ReadSessionDep, principal: PrincipalDep, project_id: str | None = None
) -> ExtractionStatus:
    project = await resolve_project(session, principal, project_id)
    record = await registry.get_extraction(session, project, generation_id)
    if record is None:
        raise not_found("generation", generation_id)
    summary = ExtractionSummary.model_validate(record, from_attributes=True)
    return ExtractionStatus(
        generation_id=generation_id,
        status=record.status,
        reason=record.reason,
        summary=summary,
        model=record.model,
        updated_at=record.updated_at,
    )
