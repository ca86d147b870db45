"""Agent and orchestration write paths: the write_memory tool for platforms on HTTP, and the orchestration write."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, BeforeValidator, Field, WithJsonSchema

from services.api.deps import (
    PrincipalDep,
    ReadSessionDep,
    require,
    resolve_project,
)
from services.api.errors import ApiError, invalid
from services.api.routes.entries import WRITE_RESPONSES, submit_write, write_id_for
from services.api.routes.memories import writable_memory_project
from services.api.routing import CheckedRoute
from services.api.schemas import Strict, Tags, WrittenMetadata
from shared import registry
from shared.agents import AgentSpec, encode_content, flatten_tags, orchestration_event
from shared.events import CONTENT_MAX_CHARS, GenerationId, SourceType, WrittenContent
from shared.ids import MEMORY_PREFIX, is_valid_id
from shared.providers import ResolutionError, agent_for_merges
from shared.tools import NO_WRITE_MEMORY, WRITE_MEMORY_TOOL, call_write_memory

router = APIRouter(tags=["agents"], route_class=CheckedRoute)
log = logging.getLogger("memories.api")


class WriteMemoryCall(Strict):
    # The model's argument as it gave it: a wrong one is told back to the model as `{error}`, not a 400 to the
    # platform (shared.tools.content_problem).
    content: Annotated[
        Any,
        WithJsonSchema({"type": "string", "maxLength": CONTENT_MAX_CHARS, "description": "the fact, as the model gave it"}),
    ] = None
    agent: AgentSpec
    generation_id: GenerationId | None = None
    memory_id: str | None = Field(default=None, description="if given, must be the agent's write_memory_id")
    project_id: str | None = None


class ToolResult(BaseModel):
    action: str | None = None
    entry_id: str | None = None
    error: str | None = None
    status: Literal["pending"] | None = Field(
        default=None, description="pending: not decided in time, queued and applied later (see /memory-writes)"
    )
    write_id: str | None = None
    message: str | None = None


@router.get("/tools/write_memory", summary="The write_memory tool definition (OpenAI tool format)")
async def write_memory_definition(_principal: PrincipalDep) -> dict[str, Any]:
    return WRITE_MEMORY_TOOL


@router.post(
    "/tools/write_memory",
    summary="Execute a write_memory tool call: the target is the agent's write_memory_id",
    dependencies=[require("memories:CreateMemoryEntry")],
    response_model_exclude_none=True,
)
async def write_memory(body: WriteMemoryCall, request: Request, session: ReadSessionDep, principal: PrincipalDep) -> ToolResult:
    if not principal.is_admin and (body.agent.api_base or body.agent.api_key_env):
        # The writer would call that address with the secret of that variable from its own environment.
        raise invalid(
            "agent.api_base and agent.api_key_env are for the admin token only; a project key uses the model's "
            "provider as the service is configured for it",
            *(f"agent.{name}" for name in ("api_base", "api_key_env") if getattr(body.agent, name)),
            status=403,
        )
    project_id = await resolve_project(session, principal, body.project_id)
    target = body.agent.knowledge_config.write_memory_id
    if body.memory_id is not None and body.memory_id != target:
        return ToolResult(error="the model cannot choose the memory: it is fixed by write_memory_id")
    if not target:
        return ToolResult(error=NO_WRITE_MEMORY)
    owners = request.app.state.memory_owners
    if not is_valid_id(target, MEMORY_PREFIX) or await owners.project_of(session, target) != project_id:
        return ToolResult(error="the agent's write_memory_id names no memory of this project")
    providers, routes, default_route = await registry.load_model_registry(session, project_id)
    try:
        agent = agent_for_merges(
            body.agent, providers=providers, routes=routes, default_route_id=default_route,
            service_model=request.app.state.settings.memories_merge_model,
            nameable_providers=request.app.state.settings.agent_model_providers,
        )
    except ResolutionError as exc:
        # A merge is optional; the fact is not: it is written as it would be with no model to merge with.
        log.warning("tool write without a merge model: %s", exc)
        agent = body.agent.model_copy(update={"model": None, "ai_provider_id": None, "model_route_id": None})
    await session.rollback()  # no pool slot held while the writer decides
    result = await call_write_memory(
        request.app.state.gateway,
        project_id=project_id,
        agent=agent,
        content=body.content,
        generation_id=body.generation_id,
        timeout=request.app.state.settings.memories_write_timeout_s,
    )
    return ToolResult(**result)


class OrchestrationWrite(Strict):
    memory_id: str
    # The rules of every other write apply to the text as it will be stored: after encoding, after flattening.
    # The published schema shows what a client may send, not the text it becomes.
    content: Annotated[
        WrittenContent | None,
        BeforeValidator(encode_content, json_schema_input_type=Any),
        Field(description="the mapped input; a non-string is stored JSON-encoded"),
    ]
    tags: Annotated[
        Tags | None,
        BeforeValidator(flatten_tags, json_schema_input_type=list[str] | dict[str, str | int | float | bool] | None),
        Field(description='a list, or a {key: value} map stored as "key:value" tags'),
    ] = None
    metadata: WrittenMetadata = None
    source_type: SourceType = SourceType.ORCHESTRATION


@router.post(
    "/orchestration/memory-write",
    status_code=201,
    summary="An orchestration memory_write node: never merges; tags may be a {key: value} map",
    dependencies=[require("memories:CreateMemoryEntry")],
    responses=WRITE_RESPONSES,
)
async def orchestration_write(
    body: OrchestrationWrite,
    request: Request,
    session: ReadSessionDep,
    principal: PrincipalDep,
    idempotency_key: Annotated[str | None, Header()] = None,
) -> JSONResponse:
    project_id = await writable_memory_project(request, session, principal, body.memory_id)
    if body.content is None:
        raise ApiError(400, "content is required", meta={"missing_fields": ["content"]})
    event = orchestration_event(
        project_id=project_id,
        memory_id=body.memory_id,
        content=body.content,
        tags=body.tags,
        metadata=body.metadata,
        source_type=body.source_type,
        write_id=write_id_for(project_id, idempotency_key, request),
    )
    return await submit_write(request, session, event, fresh_id=idempotency_key is None)
