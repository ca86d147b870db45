"""Memories: named containers of entries."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response, status
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.deps import (
    Principal,
    PrincipalDep,
    ReadSessionDep,
    SessionDep,
    require,
    resolve_project,
    scope,
)
from services.api.errors import invalid, not_found
from services.api.pagination import PagingDep, paged
from services.api.routing import CheckedRoute
from services.api.schemas import MemoryCreate, MemoryOut, MemoryUpdate, Page
from shared import repository as repo
from shared.agents import MAX_TAG_PATTERNS
from shared.db.models import Memory
from shared.events import Tag
from shared.ids import MEMORY_PREFIX, is_valid_id

router = APIRouter(prefix="/memories", tags=["memories"], route_class=CheckedRoute)



async def load_memory(
    session: AsyncSession, principal_scope: str | None, memory_id: str, *, lock: repo.MemoryLock | None = None
) -> Memory:
    """The memory, or a 404 whether it is absent, malformed or another project's (`lock`: see
    `repository.get_memory`)."""
    memory = None
    if is_valid_id(memory_id, MEMORY_PREFIX):
        memory = await repo.get_memory(session, principal_scope, memory_id, lock=lock)
    if memory is None:
        raise not_found("memory", memory_id)
    return memory


async def writable_memory_project(
    request: Request, session: AsyncSession, principal: Principal, memory_id: str
) -> str:
    """The project of a memory the caller may write to, or a 404 as `load_memory` gives.

    A write needs nothing else of the memory before it is published, and the API remembers owners
    (`MemoryOwners`): the hot path of writes then reads nothing here."""
    project_id = None
    if is_valid_id(memory_id, MEMORY_PREFIX):
        project_id = await request.app.state.memory_owners.project_of(session, memory_id)
    if project_id is None or scope(principal) not in (None, project_id):
        raise not_found("memory", memory_id)
    return project_id


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    summary="Create a memory",
    dependencies=[require("memories:CreateMemory")],
)
async def create_memory(body: MemoryCreate, session: SessionDep, principal: PrincipalDep) -> MemoryOut:
    project_id = await resolve_project(session, principal, body.project_id)
    memory = await repo.create_memory(
        session,
        project_id=project_id,
        name=body.name,
        description=body.description,
        tags=body.tags or None,  # no tags are stored as none, however sent, as an entry's are
        write_policy=body.write_policy.value,
    )
    await session.commit()
    return MemoryOut.of(memory)


@router.get(
    "",
    summary="List memories, optionally filtered by tag globs (`*`, `?`; ORed)",
    dependencies=[require("memories:ListMemories")],
)
async def list_memories(
    session: ReadSessionDep,
    principal: PrincipalDep,
    paging: PagingDep,
    project_id: str | None = None,
    # A pattern obeys the rules of a tag, as in a search's `memory_tags`: an empty one (`?tags=`) is a 400.
    tags: Annotated[list[Tag], Query(max_length=MAX_TAG_PATTERNS)] = [],  # noqa: B006 - FastAPI copies it
) -> Page[MemoryOut]:
    project = await resolve_project(session, principal, project_id)
    rows, total = await repo.list_memories(session, project, tags, paging.limit, paging.offset)
    return paged([MemoryOut.of(m) for m in rows], total, paging)


@router.get("/{memory_id}", summary="Get a memory", dependencies=[require("memories:GetMemory")])
async def get_memory(memory_id: str, session: ReadSessionDep, principal: PrincipalDep) -> MemoryOut:
    return MemoryOut.of(await load_memory(session, scope(principal), memory_id))


@router.put(
    "/{memory_id}",
    summary="Update a memory: only the fields present change",
    dependencies=[require("memories:UpdateMemory")],
)
async def update_memory(
    memory_id: str, body: MemoryUpdate, session: SessionDep, principal: PrincipalDep
) -> MemoryOut:
    # Its row only: a decision in progress (a merge waiting on its model) reads the memory as it was, and a change
    # of its write policy applies to the writes decided after this commits.
    memory = await load_memory(session, scope(principal), memory_id, lock="row")
    changes = {field: getattr(body, field) for field in body.model_fields_set}
    for required in ("name", "write_policy"):
        if required in changes and changes[required] is None:
            raise invalid(f"{required} cannot be null", required)
    if "write_policy" in changes:
        changes["write_policy"] = changes["write_policy"].value
    if "tags" in changes:
        changes["tags"] = changes["tags"] or None
    changes = {field: value for field, value in changes.items() if value != _stored(memory, field)}
    if not changes:  # nothing asked for, or nothing new: updated_at keeps saying when something last changed
        return MemoryOut.of(memory)
    memory = await repo.update_memory(session, memory, changes)
    await session.commit()
    return MemoryOut.of(memory)


@router.delete(
    "/{memory_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Delete a memory and its entries",
    dependencies=[require("memories:DeleteMemory")],
)
async def delete_memory(
    memory_id: str, request: Request, session: SessionDep, principal: PrincipalDep
) -> Response:
    memory = await load_memory(session, scope(principal), memory_id, lock="decisions")
    await repo.delete_memory(session, memory)
    await session.commit()
    # Other API processes still remember it; their writes to it are refused by the writer instead.
    request.app.state.memory_owners.forget(memory.id)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _stored(memory: Memory, field: str) -> Any:
    value = getattr(memory, field)
    return (value or None) if field == "tags" else value  # a memory of an earlier version may hold []
