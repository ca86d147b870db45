"""Projects: the tenancy boundary. Admin token only."""

from __future__ import annotations

from fastapi import APIRouter, status

from services.api.deps import AdminDep, ReadSessionDep, SessionDep
from services.api.pagination import PagingDep, paged
from services.api.routing import CheckedRoute
from services.api.schemas import Page, ProjectCreate, ProjectOut
from shared import repository as repo

router = APIRouter(prefix="/projects", tags=["projects"], route_class=CheckedRoute)


@router.post("", status_code=status.HTTP_201_CREATED, summary="Create a project")
async def create_project(body: ProjectCreate, session: SessionDep, _admin: AdminDep) -> ProjectOut:
    project = await repo.create_project(session, body.name)
    await session.commit()
    return ProjectOut.of(project)


@router.get("", summary="List projects")
async def list_projects(session: ReadSessionDep, _admin: AdminDep, paging: PagingDep) -> Page[ProjectOut]:
    rows, total = await repo.list_projects(session, paging.limit, paging.offset)
    return paged([ProjectOut.of(p) for p in rows], total, paging)
