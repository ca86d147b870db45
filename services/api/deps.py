"""Dependencies of the routes: the database session, the caller, and the caller's project."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.errors import ApiError, not_found
from shared import repository as repo
from shared.ids import PROJECT_PREFIX, is_valid_id
from shared.settings import Settings


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


@dataclass(frozen=True)
class Principal:
    """Who calls. The admin token may act in any project; it must then name one."""

    is_admin: bool
    project_id: str | None = None


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing or malformed Authorization: Bearer <token> header")
    return token.strip()


async def get_principal(request: Request) -> Principal:
    token = _bearer(request)
    admin_token = request.app.state.admin_token
    if admin_token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return Principal(is_admin=True)
    raise ApiError(401, "invalid token")


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise ApiError(403, "this route needs the admin token")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


async def resolve_project(session: AsyncSession, principal: Principal, requested: str | None) -> str:
    """The project a request acts in: the key's own, or the one an admin names."""
    if principal.project_id is not None:
        if requested is not None and requested != principal.project_id:
            raise not_found("project", requested)
        return principal.project_id
    if requested is None:
        raise ApiError(400, "project_id is required with this token", meta={"missing_fields": ["project_id"]})
    if not is_valid_id(requested, PROJECT_PREFIX) or await repo.get_project(session, requested) is None:
        raise not_found("project", requested)
    return requested


def scope(principal: Principal) -> str | None:
    """The project a by-id lookup is confined to; None lets the admin see every project."""
    return None if principal.is_admin else principal.project_id
