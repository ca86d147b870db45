"""Dependencies of the routes: the database session, the caller, and the caller's project."""

from __future__ import annotations

import hmac
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.errors import ApiError, not_found
from shared import iam
from shared import repository as repo
from shared.events import has_lone_surrogate
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
instead of BEGIN, query and ROLLBACK. A route that needs one consistent snapshot of several reads, or that
writes, takes SessionDep."""


async def refuse_unknown_query_parameters(request: Request) -> None:
    """A query parameter the route does not take is a 400, as an unknown body field is: a misspelt or
    differently encoded filter (`tag=`, `tags[]=`) must not quietly list everything."""
    if not request.query_params:
        return
    route: APIRoute = request.scope["route"]
    taken = _TAKEN_QUERY_PARAMETERS.get(route.unique_id)
    if taken is None:
        taken = _TAKEN_QUERY_PARAMETERS[route.unique_id] = frozenset(_query_parameters(route.dependant))
    unknown = [name for name in dict.fromkeys(request.query_params) if name not in taken]
    if unknown:
        raise RequestValidationError(
            [{"type": "extra_forbidden", "loc": ("query", name), "msg": "unknown query parameter"} for name in unknown]
        )


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a surrogate, paired or not: in a strict UTF-8 body, the only way a lone one gets in."""


async def refuse_lone_surrogates(request: Request) -> None:
    """A body is UTF-8 JSON (RFC 8259), and a lone surrogate in it (`"\\ud800"`: valid JSON, half of a UTF-16
    pair, as a JavaScript client that cut a string through an emoji sends it) is a 400: no UTF-8 text, so no
    column, log line or event, can hold it. Python's parser would also take UTF-16 and UTF-8 with encoded
    surrogates. A body without a surrogate escape (nearly all) costs a decode and one scan of its bytes."""
    route: APIRoute = request.scope["route"]
    if route.body_field is None:
        return  # FastAPI does not read a body this route does not take, and neither does this
    body = await request.body()
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        message = f"must be UTF-8 text: byte {exc.start} is not"
        raise RequestValidationError([{"type": "utf8", "loc": ("body",), "msg": message}]) from None
    if not _SURROGATE_ESCAPE.search(body):
        return
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return  # the route's own parsing says what is wrong
    where = _lone_surrogate_at(value)
    if where is not None:
        message = "must be Unicode text: a lone surrogate (half of a UTF-16 pair) is no character"
        raise RequestValidationError([{"type": "lone_surrogate", "loc": ("body", *where), "msg": message}])


def _lone_surrogate_at(value: Any) -> tuple[str | int, ...] | None:
    pending: list[tuple[tuple[str | int, ...], Any]] = [((), value)]
    while pending:  # not recursive: the body may nest as deep as the parser let it
        path, item = pending.pop()
        if isinstance(item, str) and has_lone_surrogate(item):
            return path
        if isinstance(item, dict):
            for key, child in item.items():
                if has_lone_surrogate(key):
                    return (*path, key)  # shown as U+FFFD by the envelope
                pending.append(((*path, key), child))
        elif isinstance(item, list):
            pending.extend(((*path, index), child) for index, child in enumerate(item))
    return None


_TAKEN_QUERY_PARAMETERS: dict[str, frozenset[str]] = {}
"""By route (`unique_id`: its name, path and method; a route object is not hashable)."""


def _query_parameters(dependant: Dependant) -> set[str]:
    own = {field.alias for field in dependant.query_params}
    return own.union(*(_query_parameters(sub) for sub in dependant.dependencies))


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
