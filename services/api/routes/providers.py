"""The model registry: AI providers, model routes and a project's default route (admin)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Response, status
from pydantic import BaseModel, Field, field_serializer

from services.api.deps import AdminDep, ReadSessionDep, SessionDep, resolve_project
from services.api.errors import ApiError, not_found
from services.api.pagination import PagingDep, page_of
from services.api.routing import CheckedRoute
from services.api.schemas import Name, Page, Strict, Timestamp
from shared import registry
from shared.agents import KeyVariable, ProviderAddress, redact_address
from shared.events import ModelName, Text

router = APIRouter(tags=["model registry"], route_class=CheckedRoute)

RegisteredModel = Annotated[ModelName, Field(min_length=1)]


class ProviderCreate(Strict):
    project_id: str | None = None
    name: Name
    provider: Annotated[str, Field(pattern=r"^[a-z0-9_\-]{1,64}$", description="litellm prefix, e.g. openai")]
    api_base: ProviderAddress | None = None
    api_key_env: KeyVariable | None = Field(default=None, description="NAME of the env variable with the key")
    default_model: RegisteredModel | None = None


class ProviderOut(BaseModel):
    id: str
    project_id: str
    name: str
    provider: str
    api_base: str | None
    api_key_env: str | None
    default_model: str | None
    created_at: Timestamp

    @field_serializer("api_base")
    def _shown_without_credentials(self, api_base: str | None) -> str | None:
        return redact_address(api_base) if api_base else api_base  # one stored before they were refused


class RouteTarget(Strict):
    ai_provider_id: Text
    model: RegisteredModel | None = None


class RouteCreate(Strict):
    project_id: str | None = None
    name: Name
    targets: Annotated[list[RouteTarget], Field(min_length=1, max_length=10)]


class RouteOut(BaseModel):
    id: str
    project_id: str
    name: str
    targets: list[RouteTarget]
    created_at: Timestamp


class DefaultRoute(Strict):
    model_route_id: Text | None


class UsageOut(BaseModel):
    """A project's model calls for one provider, model and purpose."""

    ai_provider_id: str | None = Field(description="none: a model named without a registered provider")
    model: str
    purpose: str = Field(description="extraction, merge or arbitration")
    calls: int
    prompt_tokens: int
    completion_tokens: int


@router.post("/ai-providers", status_code=status.HTTP_201_CREATED, summary="Register an AI provider")
async def create_provider(body: ProviderCreate, session: SessionDep, admin: AdminDep) -> ProviderOut:
    project_id = await resolve_project(session, admin, body.project_id)
    provider = await registry.create_provider(session, project_id, **body.model_dump(exclude={"project_id"}))
    await session.commit()
    return ProviderOut.model_validate(provider, from_attributes=True)


@router.get("/ai-providers", summary="A project's AI providers")
async def list_providers(
    session: ReadSessionDep, admin: AdminDep, paging: PagingDep, project_id: str | None = None
) -> Page[ProviderOut]:
    project = await resolve_project(session, admin, project_id)
    rows = await registry.list_providers(session, project)
    return page_of([ProviderOut.model_validate(p, from_attributes=True) for p in rows], paging)


@router.delete("/ai-providers/{provider_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Remove a provider")
async def delete_provider(provider_id: str, session: SessionDep, _admin: AdminDep) -> Response:
    provider = await registry.get_provider(session, None, provider_id)
    if provider is None:
        raise not_found("AI provider", provider_id)
    await registry.lock_registry(session, provider.project_id)  # no route is created to name it meanwhile
    # A route left naming it would fail every call it serves, silently: the route must go or change first.
    using = [r.id for r in await registry.list_routes(session, provider.project_id)
             if any(t.get("ai_provider_id") == provider.id for t in r.targets)]
    if using:
        raise ApiError(409, f"AI provider {provider.id} is a target of model routes; delete them first",
                       meta={"model_route_ids": using})
    await registry.delete_provider(session, provider)
    await session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post("/model-routes", status_code=status.HTTP_201_CREATED, summary="A route: ordered failover targets")
async def create_route(body: RouteCreate, session: SessionDep, admin: AdminDep) -> RouteOut:
    project_id = await resolve_project(session, admin, body.project_id)
    await registry.lock_registry(session, project_id)  # no target deleted meanwhile
    for target in body.targets:
        if await registry.get_provider(session, project_id, target.ai_provider_id) is None:
            raise not_found("AI provider", target.ai_provider_id)  # as any unknown id, here a route's target
    targets = [t.model_dump() for t in body.targets]
    route = await registry.create_route(session, project_id, body.name, targets)
    await session.commit()
    return RouteOut.model_validate(route, from_attributes=True)


@router.get("/model-routes", summary="A project's model routes")
async def list_routes(
    session: ReadSessionDep, admin: AdminDep, paging: PagingDep, project_id: str | None = None
) -> Page[RouteOut]:
    project = await resolve_project(session, admin, project_id)
    rows = await registry.list_routes(session, project)
    return page_of([RouteOut.model_validate(r, from_attributes=True) for r in rows], paging)


@router.delete("/model-routes/{route_id}", status_code=status.HTTP_204_NO_CONTENT, summary="Remove a route")
async def delete_route(route_id: str, session: SessionDep, _admin: AdminDep) -> Response:
    route = await registry.get_route(session, None, route_id)
    if route is None:
        raise not_found("model route", route_id)
    await registry.lock_registry(session, route.project_id)  # not made the default meanwhile
    await registry.delete_route(session, route)
    await session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.get("/projects/{project_id}/default-model-route", summary="The project's default route, if it has one")
async def get_default_route(project_id: str, session: ReadSessionDep, admin: AdminDep) -> DefaultRoute:
    project = await resolve_project(session, admin, project_id)
    return DefaultRoute(model_route_id=await registry.get_default_route(session, project))


@router.put("/projects/{project_id}/default-model-route", summary="Set or clear the project's default route")
async def set_default_route(project_id: str, body: DefaultRoute, session: SessionDep, admin: AdminDep) -> DefaultRoute:
    project = await resolve_project(session, admin, project_id)
    await registry.lock_registry(session, project)  # the route not deleted meanwhile
    if body.model_route_id is not None and await registry.get_route(session, project, body.model_route_id) is None:
        raise not_found("model route", body.model_route_id)
    await registry.set_default_route(session, project, body.model_route_id)
    await session.commit()
    return body


@router.get("/usage", summary="LLM token usage of a project by provider, model and purpose")
async def usage(
    session: ReadSessionDep, admin: AdminDep, paging: PagingDep, project_id: str | None = None
) -> Page[UsageOut]:
    project = await resolve_project(session, admin, project_id)
    return page_of([UsageOut(**row) for row in await registry.usage_summary(session, project)], paging)
