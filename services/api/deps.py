"""Dependencies of the routes: the database session, the caller, and the caller's project."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.errors import ApiError, not_found
from shared import iam
from shared import repository as repo
from shared.ids import PROJECT_PREFIX, is_valid_id
from shared.settings import Settings


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as session:
        yield session


async def get_read_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.read_sessions() as session:
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]
"""For routes that change rows: statements share one transaction, committed by the route."""

ReadSessionDep = Annotated[AsyncSession, Depends(get_read_session)]
"""For routes that only read: each statement commits on its own (autocommit), one round trip per query
instead of BEGIN, query and ROLLBACK. Each statement sees what was committed when it started, as it would in a
transaction too (READ COMMITTED): a page and its total may differ by a row committed in between either way. A
route that writes takes SessionDep."""


# Dependencies are `async def` even when they await nothing: FastAPI runs a plain `def` dependency in its
# thread pool, a thread hop on every request.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


SettingsDep = Annotated[Settings, Depends(get_settings)]


@dataclass(frozen=True)
class Principal:
    """Who calls. The admin token may act in any project and may do anything, but must name the project;
    an API key acts only in its own project and only as far as its action patterns allow."""

    is_admin: bool
    project_id: str | None = None
    actions: frozenset[str] = frozenset()
    key_id: str | None = None

    def can(self, action: str) -> bool:
        return self.is_admin or iam.allows(self.actions, action)


def _bearer(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "missing or malformed Authorization: Bearer <token> header")
    return token.strip()


async def get_principal(request: Request, session: ReadSessionDep) -> Principal:
    token = _bearer(request)
    admin_token = request.app.state.admin_token
    if admin_token and hmac.compare_digest(token.encode(), admin_token.encode()):
        return Principal(is_admin=True)
    if token.startswith(iam.SECRET_PREFIX):
        key = await request.app.state.live_keys.lookup(session, token)
        # Its connection back to the pool now, not when the response is sent: the route may wait seconds on a
        # model (an edit's embedding) holding none. A route that reads through this session takes one again.
        await session.close()
        if key is not None:
            return Principal(is_admin=False, project_id=key.project_id, actions=key.actions, key_id=key.id)
    raise ApiError(401, "invalid token")


PrincipalDep = Annotated[Principal, Depends(get_principal)]


async def require_admin(principal: PrincipalDep) -> Principal:
    if not principal.is_admin:
        raise ApiError(403, "this route needs the admin token")
    return principal


AdminDep = Annotated[Principal, Depends(require_admin)]


def require(*actions: str) -> Any:
    """A route dependency: the caller must hold at least one of these IAM actions, else 403.

    It runs before the route looks anything up, so a key without the action learns nothing about ids."""
    unknown = set(actions) - iam.ACTIONS
    if not actions or unknown:
        raise ValueError(f"not IAM actions: {sorted(unknown) or 'none given'}")

    async def holds_action(principal: PrincipalDep) -> Principal:
        if not any(principal.can(action) for action in actions):
            needed = " or ".join(actions)
            raise ApiError(403, f"this key lacks the {needed} permission", meta={"actions": list(actions)})
        return principal

    return Depends(holds_action)


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
