"""Provenance clean-up for platforms on HTTP: a generation or a conversation was deleted, and the entries it gave
forget it while the facts stay (the bus's `generations.deleted.*` and `conversations.deleted.*` do the same)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, Field
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.deps import Principal, PrincipalDep, SessionDep, require, resolve_project
from services.api.routing import CheckedRoute
from shared import repository as repo

router = APIRouter(tags=["provenance"], route_class=CheckedRoute)


class ProvenanceCleared(BaseModel):
    cleared: int = Field(description="how many entries referenced it")


# An empty id is a client's slip (a path built from a missing variable), not a generation: a 400 says so. A longer
# id than a write may cite is a no-op (nothing holds it, nothing is remembered), as deleting what is gone should be.
ForgottenId = Annotated[str, Path(min_length=1)]


@router.delete(
    "/generations/{generation_id:path}/provenance",  # `:path`: an id may hold a "/" (e.g. run/42)
    summary="A generation was deleted: entries forget it, the facts stay",
    dependencies=[require("memories:UpdateMemoryEntry")],
)
async def forget_generation(
    generation_id: ForgottenId, session: SessionDep, principal: PrincipalDep, project_id: str | None = None
) -> ProvenanceCleared:
    return await _forget(session, principal, project_id, generation_id=generation_id)


@router.delete(
    "/conversations/{conversation_id:path}/provenance",
    summary="A conversation was deleted: entries forget it, the facts stay",
    dependencies=[require("memories:UpdateMemoryEntry")],
)
async def forget_conversation(
    conversation_id: ForgottenId, session: SessionDep, principal: PrincipalDep, project_id: str | None = None
) -> ProvenanceCleared:
    return await _forget(session, principal, project_id, conversation_id=conversation_id)


async def _forget(
    session: AsyncSession, principal: Principal, project_id: str | None, **reference: str
) -> ProvenanceCleared:
    project = await resolve_project(session, principal, project_id)
    cleared = await repo.clear_provenance(session, project, **reference)
    await session.commit()
    return ProvenanceCleared(cleared=cleared)
