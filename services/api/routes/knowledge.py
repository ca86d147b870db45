"""Knowledge search and the reference-context block an agent platform injects before a model turn."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy.ext.asyncio import AsyncSession

from services.api.deps import Principal, PrincipalDep, SessionDep, SettingsDep, require, resolve_project
from services.api.errors import ApiError
from services.api.knowledge_schemas import (
    KnowledgeContextRequest,
    KnowledgeContextResponse,
    KnowledgeResult,
    KnowledgeSearch,
    KnowledgeSearchResponse,
)
from services.api.routing import CheckedRoute
from shared.context import reference_context
from shared.embeddings import EmbeddingError
from shared.events import is_blank
from shared.search import KnowledgeFilter, search_knowledge

router = APIRouter(prefix="/knowledge", tags=["knowledge"], route_class=CheckedRoute)


def _nothing_to_search(*fields: str) -> ApiError:
    """A 400 naming the request's own fields, one of which was needed."""
    return ApiError(400, f"give {', '.join(fields[:-1])} or {fields[-1]}", meta={"missing_fields": list(fields)})


async def _project_without_a_transaction(session: AsyncSession, principal: Principal, requested: str | None) -> str:
    """The request's project; the admin's is read from the database, whose connection goes back to the pool before
    the query is embedded (the model may take seconds: a remote one up to 30 s)."""
    project_id = await resolve_project(session, principal, requested)
    await session.rollback()
    return project_id


@router.post(
    "/search",
    summary="Search entries by similarity, or list them by age without a query",
    description=(
        "Entries of the memories in `memory_ids`, all entries of the memories whose tags match a `memory_tags` "
        "glob, and the entries whose own tags match one: their union, valid entries only, in the caller's "
        "project only. A memory id that is malformed, unknown or of another project contributes nothing "
        "(no 404), as an agent's stored configuration may name a memory since deleted. `limit` defaults to 10 "
        "and is clamped to 1..100 like the list endpoints. With `query`: nearest first, `score` = "
        "`similarity_score` = 1 − cosine distance, at least `min_score`. Without: oldest first, no score."
    ),
    response_model=KnowledgeSearchResponse,
    dependencies=[require("knowledge:SearchKnowledge")],
)
async def search(
    body: KnowledgeSearch, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> JSONResponse:
    project_id = await _project_without_a_transaction(session, principal, body.project_id)
    filters = KnowledgeFilter(memory_ids=tuple(body.memory_ids), tag_patterns=tuple(body.memory_tags))
    if (body.query is None or is_blank(body.query)) and not filters.given:
        raise _nothing_to_search("query", "memory_ids", "memory_tags")
    try:
        found = await search_knowledge(
            session,
            project_id=project_id,
            query=body.query,
            filters=filters,
            limit=body.limit,
            min_score=body.min_score,
            embedding_model=settings.embedding_model,
            dimensions=settings.embedding_dimensions,
        )
    except EmbeddingError as exc:
        raise ApiError(503, str(exc)) from exc
    return JSONResponse({"results": [KnowledgeResult.json_of(hit) for hit in found.hits]})


@router.post(
    "/context",
    summary="The reference-context message for an agent's knowledge_config and the last user message",
    description=(
        "Runs the search of `knowledge_config` (snake_case or camelCase; `write_memory_id` and `extraction` "
        "are accepted and ignored) with `message` as the query and returns the user-role message to put "
        "before the user's turn: a one-line preamble saying it is reference material and not instructions, "
        "then `<knowledge>`, one `[Memory: {memory_name} ({entry_id})] {content}` line per result, `</knowledge>`. "
        "`<`, `>` and `&` in names and contents are escaped as `&lt;`, `&gt;`, `&amp;` and line breaks "
        "folded to spaces, so no entry can end the block or forge a line. `message` is null when nothing "
        "was found. The same is `shared.context.reference_context` for a platform in Python."
    ),
    response_model=KnowledgeContextResponse,
    dependencies=[require("knowledge:SearchKnowledge")],
)
async def context(
    body: KnowledgeContextRequest, session: SessionDep, principal: PrincipalDep, settings: SettingsDep
) -> JSONResponse:
    project_id = await _project_without_a_transaction(session, principal, body.project_id)
    if (body.message is None or is_blank(body.message)) and not body.knowledge_config.filters.given:
        raise _nothing_to_search("message", "knowledge_config.memory_ids", "knowledge_config.memory_tags")
    try:
        built = await reference_context(
            session,
            project_id=project_id,
            config=body.knowledge_config,
            message=body.message,
            embedding_model=settings.embedding_model,
            dimensions=settings.embedding_dimensions,
        )
    except EmbeddingError as exc:
        raise ApiError(503, str(exc)) from exc
    results = [KnowledgeResult.json_of(hit) for hit in built.results.hits]
    return JSONResponse({"message": built.message, "results": results})
