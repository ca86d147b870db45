"""API keys: project-scoped bearer credentials holding IAM action patterns. Admin token only.

The secret (`sk_…`) is returned once, by the creation; the database keeps its hash and a short display
prefix. A revocation is broadcast to every API process, which forgets the key (services.api.keys.LiveKeys).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request, Response, status
from pydantic import AfterValidator, BaseModel, Field

from services.api.deps import AdminDep, ReadSessionDep, SessionDep, resolve_project
from services.api.errors import not_found
from services.api.pagination import Flag, PagingDep, paged
from services.api.routing import CheckedRoute
from services.api.schemas import Name, OptionalTimestamp, Page, Strict, Timestamp
from shared import iam
from shared import repository as repo
from shared.db.models import ApiKey
from shared.ids import API_KEY_PREFIX, is_valid_id

router = APIRouter(prefix="/api-keys", tags=["api keys"], route_class=CheckedRoute)

MAX_ACTIONS = 64


def _known_pattern(pattern: str) -> str:
    if not iam.is_valid_pattern(pattern):
        raise ValueError("not an IAM action, nor a `*` pattern matching one (e.g. `memories:*`)")
    return pattern


def _distinct(patterns: list[str]) -> list[str]:
    return list(dict.fromkeys(patterns))


ActionPattern = Annotated[str, AfterValidator(_known_pattern)]


class ApiKeyCreate(Strict):
    project_id: str
    name: Name | None = None
    actions: Annotated[
        list[ActionPattern],
        Field(min_length=1, max_length=MAX_ACTIONS, description="actions or patterns: `memories:*`, `*`"),
        AfterValidator(_distinct),
    ]


class ApiKeyOut(BaseModel):
    id: str
    project_id: str
    name: str | None
    prefix: str = Field(description="the secret's first characters, to tell keys apart; not a credential")
    actions: list[str]
    created_at: Timestamp
    revoked_at: OptionalTimestamp

    @classmethod
    def of(cls, key: ApiKey) -> ApiKeyOut:
        return cls.model_validate(key, from_attributes=True)


class ApiKeyCreated(ApiKeyOut):
    key: str = Field(description="the bearer secret; shown only in this response, it cannot be recovered")


@router.post("", status_code=status.HTTP_201_CREATED, summary="Create an API key; its secret is shown once")
async def create_api_key(
    body: ApiKeyCreate, session: SessionDep, admin: AdminDep, response: Response
) -> ApiKeyCreated:
    project_id = await resolve_project(session, admin, body.project_id)
    key, secret = await repo.create_api_key(
        session, project_id=project_id, name=body.name, actions=body.actions
    )
    await session.commit()
    response.headers["Cache-Control"] = "no-store"
    return ApiKeyCreated(**ApiKeyOut.of(key).model_dump(), key=secret)


@router.get("", summary="List a project's API keys (live ones unless include_revoked); secrets never appear")
async def list_api_keys(
    session: ReadSessionDep,
    admin: AdminDep,
    paging: PagingDep,
    project_id: str | None = None,
    include_revoked: Flag = False,
) -> Page[ApiKeyOut]:
    project = await resolve_project(session, admin, project_id)
    rows, total = await repo.list_api_keys(session, project, include_revoked, paging.limit, paging.offset)
    return paged([ApiKeyOut.of(k) for k in rows], total, paging)


@router.delete(
    "/{key_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    summary="Revoke an API key at once",
    description=(
        "The answer comes once every API process has forgotten the key (they remember live keys for up to "
        "`MEMORIES_API_KEY_CACHE_S`), so the next request with it is a 401 wherever it lands; this takes about "
        "50 ms longer than other calls. A key already revoked is a 404."
    ),
)
async def revoke_api_key(key_id: str, request: Request, session: SessionDep, _admin: AdminDep) -> Response:
    if not (is_valid_id(key_id, API_KEY_PREFIX) and await repo.revoke_api_key(session, key_id)):
        raise not_found("api key", key_id)
    await session.commit()
    await request.app.state.live_keys.revoked(key_id)  # answered once the API processes forgot it
    return Response(status_code=status.HTTP_204_NO_CONTENT)
