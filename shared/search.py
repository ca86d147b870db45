"""Knowledge search: the valid entries a request may see, ranked by cosine similarity or listed by age.

Which entries: those of the memories named by id, all entries of the memories whose own tags match a glob,
and the entries whose own tags match a glob; only in the caller's project, never an invalidated one.

How they are ranked. An HNSW index answers "the nearest k" quickly but knows nothing of filters: on a
filter that keeps few rows, a plain index scan stops with fewer than k of them. So a small filtered set
(at most `exact_scan_max` rows, counted with a capped query) is ranked exactly, by computing every distance;
a larger one goes through the index with pgvector's iterative scan, which keeps walking the graph until k
rows pass the filter, and falls back to the exact ranking if the walk still comes back short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, Select, and_, false, func, literal_column, or_, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from shared.db.models import Memory, MemoryEntry
from shared.embeddings import embed_texts
from shared.ids import MEMORY_PREFIX, is_valid_id
from shared.repository import glob_to_like, tags_match_any

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
EXACT_SCAN_MAX = 5_000
"""Filtered sets up to this size are ranked exactly. Measured on 2 cores (docs/benchmarks.md): ranking 5,000
rows exactly costs about what an iterative index scan costs at that selectivity in a 100k-entry table,
and it is always right."""

_TAG_SEPARATOR = "\x1f"  # the separator memory_tags_text() (migration 0002) puts around each tag


def clamp_limit(limit: int | None) -> int:
    """Like the list endpoints: the default when absent, otherwise clamped to 1..MAX_LIMIT."""
    return DEFAULT_LIMIT if limit is None else max(1, min(MAX_LIMIT, limit))


def ef_search_for(limit: int) -> int:
    """The HNSW candidate list for a query of `limit` results: recall@10 falls below 0.95 under 100
    on 100k MiniLM vectors (docs/benchmarks.md), and the list must never be shorter than the limit."""
    return min(1_000, max(100, 4 * limit))


@dataclass(frozen=True)
class KnowledgeFilter:
    memory_ids: Sequence[str] = ()
    tag_patterns: Sequence[str] = ()

    @property
    def given(self) -> bool:
        return bool(self.memory_ids or self.tag_patterns)


@dataclass(frozen=True)
class KnowledgeHit:
    entry_id: str
    memory_id: str
    memory_name: str
    content: str
    tags: list[str] | None
    created_at: datetime
    updated_at: datetime
    score: float | None
    """Cosine similarity to the query (1 − cosine distance); None when listed without a query."""


class SearchPath(StrEnum):
    """How the rows were found; reported by the benchmark, and checked by the tests."""

    LISTED = "listed"  # no query: by created_at
    EXACT = "exact"  # every distance of the filtered set computed
    INDEX = "index"  # HNSW iterative scan
    INDEX_THEN_EXACT = "index+exact"  # the index walk came back short; ranked exactly instead
    NOTHING = "nothing"  # the filters named nothing in this project


@dataclass(frozen=True)
class KnowledgeResults:
    hits: list[KnowledgeHit]
    path: SearchPath
    candidates: int | None = field(default=None)
    """The filtered set's size, counted up to exact_scan_max + 1 (None when not counted)."""


async def search_knowledge(
    session: AsyncSession,
    *,
    project_id: str,
    query: str | None,
    filters: KnowledgeFilter,
    limit: int = DEFAULT_LIMIT,
    min_score: float | None = None,
    embedding_model: str,
    dimensions: int | None,
) -> KnowledgeResults:
    """Embed the query (when there is one) and search. Raises EmbeddingError when the model fails."""
    vector = None
    if query is not None and query.strip():
        [vector] = await embed_texts([query], model=embedding_model, dimensions=dimensions)
    return await search_by_vector(
        session, project_id=project_id, vector=vector, filters=filters, limit=limit, min_score=min_score
    )


async def search_by_vector(
    session: AsyncSession,
    *,
    project_id: str,
    vector: Sequence[float] | None,
    filters: KnowledgeFilter,
    limit: int = DEFAULT_LIMIT,
    min_score: float | None = None,
    exact_scan_max: int = EXACT_SCAN_MAX,
) -> KnowledgeResults:
    """The search itself, on a vector already embedded. Reads only; never commits. The HNSW settings are
    SET LOCAL, so they end with the caller's transaction."""
    limit = clamp_limit(limit)
    condition = await entry_condition(session, project_id, filters)
    if condition is None:
        return KnowledgeResults([], SearchPath.NOTHING)
    if vector is None:
        listed = select(MemoryEntry.id.label("entry_id"), literal_column("NULL::float8").label("distance"))
        listed = listed.where(condition).order_by(MemoryEntry.created_at, MemoryEntry.id).limit(limit)
        return KnowledgeResults(await _details(session, listed, by_distance=False), SearchPath.LISTED)

    candidates = await _count_up_to(session, condition, exact_scan_max)
    if candidates <= exact_scan_max:
        rows = await _details(session, exact_statement(condition, vector, limit), by_distance=True)
        return KnowledgeResults(_above(rows, min_score), SearchPath.EXACT, candidates)
    await _tune_index_scan(session, limit)
    rows = await _details(session, index_statement(condition, vector, limit), by_distance=True)
    path = SearchPath.INDEX
    if len(rows) < limit:
        # The set holds more than exact_scan_max >= limit rows, so a short walk missed some: the
        # iterative scan gave up (hnsw.max_scan_tuples) before enough rows passed the filter.
        rows = await _details(session, exact_statement(condition, vector, limit), by_distance=True)
        path = SearchPath.INDEX_THEN_EXACT
    return KnowledgeResults(_above(rows, min_score), path, candidates)


async def entry_condition(
    session: AsyncSession, project_id: str, filters: KnowledgeFilter
) -> ColumnElement[bool] | None:
    """The WHERE clause of the entries a request may see; None when its filters name nothing here.

    Memory ids that are malformed, unknown or of another project contribute nothing, like an id
    that no longer exists: an agent's stored configuration must not break search when a memory goes."""
    visible = and_(MemoryEntry.project_id == project_id, MemoryEntry.invalidated_at.is_(None))
    if not filters.given:
        return visible
    memory_ids = await _matching_memory_ids(session, project_id, filters)
    scope: list[ColumnElement[bool]] = []
    if memory_ids:
        scope.append(MemoryEntry.memory_id.in_(memory_ids))
    if filters.tag_patterns:
        scope.append(_own_tags_match(filters.tag_patterns))
    if not scope:
        return None
    return and_(visible, or_(*scope))


async def _matching_memory_ids(session: AsyncSession, project_id: str, filters: KnowledgeFilter) -> list[str]:
    named = [memory_id for memory_id in filters.memory_ids if is_valid_id(memory_id, MEMORY_PREFIX)]
    conditions: list[ColumnElement[bool]] = []
    if named:
        conditions.append(Memory.id.in_(named))
    if filters.tag_patterns:
        conditions.append(tags_match_any(Memory.tags, filters.tag_patterns))
    if not conditions:
        return []
    query = select(Memory.id).where(Memory.project_id == project_id, or_(*conditions))
    return list((await session.scalars(query)).all())


def _own_tags_match(patterns: Sequence[str]) -> ColumnElement[bool]:
    """Entry granularity. The trigram index (migration 0002) finds candidates, a superset since a LIKE
    wildcard may span separators; the exact per-tag glob decides."""
    joined = func.memory_tags_text(MemoryEntry.tags)
    wrapped = [f"%{_TAG_SEPARATOR}{glob_to_like(p)}{_TAG_SEPARATOR}%" for p in patterns]
    prefilter = or_(*[joined.like(like) for like in wrapped]) if wrapped else false()
    return and_(prefilter, tags_match_any(MemoryEntry.tags, patterns))


async def _count_up_to(session: AsyncSession, condition: ColumnElement[bool], cap: int) -> int:
    capped = select(literal_column("1")).select_from(MemoryEntry).where(condition).limit(cap + 1).subquery()
    return int(await session.scalar(select(func.count()).select_from(capped)) or 0)


def exact_statement(condition: ColumnElement[bool], vector: Sequence[float], limit: int) -> Select[Any]:
    """Every distance of the filtered set, then the nearest `limit`. MATERIALIZED keeps the planner from
    answering the ORDER BY with the HNSW index, which would bring back the approximation."""
    distance = MemoryEntry.embedding.cosine_distance(vector)
    scored = select(MemoryEntry.id.label("entry_id"), distance.label("distance")).where(condition)
    scored_cte = scored.cte("scored").prefix_with("MATERIALIZED")
    return select(scored_cte).order_by(scored_cte.c.distance, scored_cte.c.entry_id).limit(limit)


def index_statement(condition: ColumnElement[bool], vector: Sequence[float], limit: int) -> Select[Any]:
    """The nearest `limit` through the HNSW index. ORDER BY the bare distance expression is what lets the
    planner use the index; the partial index also needs `invalidated_at IS NULL`, which the condition has.
    The relaxed iterative scan returns rows slightly out of order, so the caller sorts them again."""
    distance = MemoryEntry.embedding.cosine_distance(vector)
    return (
        select(MemoryEntry.id.label("entry_id"), distance.label("distance"))
        .where(condition)
        .order_by(distance)
        .limit(limit)
    )


async def _tune_index_scan(session: AsyncSession, limit: int) -> None:
    await session.execute(
        text(
            "SELECT set_config('hnsw.ef_search', :ef, true), "
            "set_config('hnsw.iterative_scan', 'relaxed_order', true)"
        ),
        {"ef": str(ef_search_for(limit))},
    )


async def _details(session: AsyncSession, ranked: Select[Any], *, by_distance: bool) -> list[KnowledgeHit]:
    """The rows of a ranked (entry_id, distance) statement with what a result shows."""
    found = ranked.cte("found").prefix_with("MATERIALIZED")
    order = (found.c.distance, MemoryEntry.id) if by_distance else (MemoryEntry.created_at, MemoryEntry.id)
    query = (
        select(
            MemoryEntry.id,
            MemoryEntry.memory_id,
            Memory.name,
            MemoryEntry.content,
            MemoryEntry.tags,
            MemoryEntry.created_at,
            MemoryEntry.updated_at,
            found.c.distance,
        )
        .join(found, found.c.entry_id == MemoryEntry.id)
        .join(Memory, Memory.id == MemoryEntry.memory_id)
        .order_by(*order)
    )
    return [
        KnowledgeHit(
            entry_id=row.id,
            memory_id=row.memory_id,
            memory_name=row.name,
            content=row.content,
            tags=row.tags,
            created_at=row.created_at,
            updated_at=row.updated_at,
            score=None if row.distance is None else 1.0 - float(row.distance),
        )
        for row in (await session.execute(query)).all()
    ]


def _above(hits: list[KnowledgeHit], min_score: float | None) -> list[KnowledgeHit]:
    # Applied after ranking: a distance bound inside the index scan would make it walk on for rows
    # that can never pass.
    if min_score is None:
        return hits
    return [hit for hit in hits if hit.score is not None and hit.score >= min_score]
