"""Knowledge search: the valid entries a request may see, ranked by cosine similarity or listed by age.

Which entries: those of the memories named by id, all entries of the memories whose own tags match a glob,
and the entries whose own tags match a glob; only in the caller's project, never an invalidated one.

How they are ranked. An HNSW index answers "the nearest k" quickly but knows nothing of filters: on a
filter that keeps few rows, a plain index scan stops with fewer than k of them, and an iterative one walks
much of the graph to find them. So a filtered set that the planner estimates at most `exact_scan_max`
rows is ranked exactly, every distance computed; a larger one goes through the index with pgvector's
iterative scan, which keeps walking the graph until k rows pass the filter. Whenever a guess is wrong (a
stale estimate, a walk that gives up), the exact ranking answers instead: a wrong guess costs time, never
results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import (
    ClauseElement,
    ColumnElement,
    Executable,
    Select,
    Text,
    and_,
    any_,
    bindparam,
    false,
    func,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.ext.compiler import compiles

from shared.db.models import Memory, MemoryEntry
from shared.embeddings import embed_texts
from shared.events import is_blank
from shared.ids import MEMORY_PREFIX, is_valid_id
from shared.repository import glob_to_like, tags_match_any

DEFAULT_LIMIT = 10
MAX_LIMIT = 100
EXACT_SCAN_MAX = 5_000
"""Filtered sets the planner estimates at most this large are ranked exactly. On 2 cores at 100k entries
(docs/benchmarks.md) exact ranking costs a few microseconds a row, and an iterative index scan that must
walk past many rows of other memories costs about as much as exact ranking of 2,500 to 5,000 rows."""

_TAG_SEPARATOR = "\x1f"  # the separator memory_tags_text() (migration 0002) puts around each tag


def clamp_limit(limit: int | None) -> int:
    """Like the list endpoints: the default when absent, otherwise clamped to 1..MAX_LIMIT."""
    return DEFAULT_LIMIT if limit is None else max(1, min(MAX_LIMIT, limit))


def ef_search_for(limit: int, selectivity: float = 1.0) -> int:
    """The HNSW candidate list for `limit` results from a filter that keeps `selectivity` of the index.

    The filtered 10th-nearest is about the (10 / selectivity)-th nearest of the whole index, so the list
    grows with the inverse selectivity. Measured on 100k MiniLM vectors (docs/benchmarks.md): unfiltered
    recall@10 is 0.96 at 100 and 0.97 at 200; a filter keeping 13% needs about 300 to pass 0.95. Never
    shorter than the limit, and at most 1,000 (below that selectivity, search ranks exactly)."""
    wanted = max(200, 4 * limit, 4 * limit / max(selectivity, 1e-6))
    return int(min(1_000, wanted))


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
    estimate: float | None = field(default=None)
    """The planner's estimate of the filtered set's size (None when not needed)."""


async def search_knowledge(
    session: AsyncSession,
    *,
    project_id: str,
    query: str | None,
    filters: KnowledgeFilter,
    limit: int | None = DEFAULT_LIMIT,
    min_score: float | None = None,
    embedding_model: str,
    dimensions: int | None,
) -> KnowledgeResults:
    """Embed the query (when there is one) and search. Raises EmbeddingError when the model fails."""
    vector = None
    if query is not None and not is_blank(query):
        [vector] = await embed_texts([query], model=embedding_model, dimensions=dimensions, purpose="search")
    return await search_by_vector(
        session, project_id=project_id, vector=vector, filters=filters, limit=limit, min_score=min_score
    )


async def search_by_vector(
    session: AsyncSession,
    *,
    project_id: str,
    vector: Sequence[float] | None,
    filters: KnowledgeFilter,
    limit: int | None = DEFAULT_LIMIT,
    min_score: float | None = None,
    exact_scan_max: int = EXACT_SCAN_MAX,
) -> KnowledgeResults:
    """The search itself, on a vector already embedded. Reads only and never commits; the index settings
    live in a savepoint that is rolled back, so the caller's transaction is left as it was."""
    wanted = clamp_limit(limit)
    condition = await entry_condition(session, project_id, filters)
    if condition is None:
        return KnowledgeResults([], SearchPath.NOTHING)
    if vector is None:
        listed = _with_details(select().where(condition)).order_by(MemoryEntry.created_at, MemoryEntry.id)
        rows = (await session.execute(listed.limit(wanted))).all()
        return KnowledgeResults([_hit(row, None) for row in rows], SearchPath.LISTED)

    estimate = await estimate_rows(session, condition)
    if estimate <= exact_scan_max:
        # Bounded, in case the statistics are stale and the set is far larger than estimated.
        bound = max(4 * exact_scan_max, MAX_LIMIT)
        hits = await _ranked_exactly(session, condition, vector, wanted, bound)
        if hits is not None:
            return KnowledgeResults(_above(hits, min_score), SearchPath.EXACT, estimate)
    selectivity = estimate / max(await _indexed_rows(session), estimate, 1.0)
    hits = await _ranked_by_index(session, condition, vector, wanted, ef_search_for(wanted, selectivity))
    if len(hits) < wanted:
        # Either the set is smaller than the estimate said, or the walk gave up (hnsw.max_scan_tuples)
        # before enough rows passed the filter: the exact ranking is right in both cases.
        exact = await _ranked_exactly(session, condition, vector, wanted, None)
        assert exact is not None  # unbounded
        return KnowledgeResults(_above(exact, min_score), SearchPath.INDEX_THEN_EXACT, estimate)
    return KnowledgeResults(_above(hits, min_score), SearchPath.INDEX, estimate)


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
        # One array parameter, however many memories a tag matches (one per end user is the seed's layout): as
        # a list, past 65,535 ids the statement could not be sent. The planner estimates it the same way.
        scope.append(MemoryEntry.memory_id == any_(bindparam("scope_memory_ids", memory_ids, type_=ARRAY(Text))))
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
    wrapped = [f"%{_TAG_SEPARATOR}" + glob_to_like(p) + f"{_TAG_SEPARATOR}%" for p in patterns]
    prefilter = or_(*[joined.like(like) for like in wrapped]) if wrapped else false()
    return and_(prefilter, tags_match_any(MemoryEntry.tags, patterns))


class _Explain(Executable, ClauseElement):
    """EXPLAIN (FORMAT JSON) of a statement, its parameters bound as when it runs."""

    inherit_cache = False

    def __init__(self, statement: Select[Any]) -> None:
        self.statement = statement


@compiles(_Explain, "postgresql")
def _compile_explain(element: _Explain, compiler: Any, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + str(compiler.process(element.statement, **kw))


async def estimate_rows(session: AsyncSession, condition: ColumnElement[bool]) -> float:
    """The planner's estimate of the filtered set's size: planning only, a fraction of a millisecond,
    where counting a large set would read it. Tag globs are estimated from the extended statistics of
    migration 0002; a wrong estimate costs time, never results."""
    plan = await session.scalar(
        _Explain(select(literal_column("1")).select_from(MemoryEntry).where(condition))
    )
    return float(plan[0]["Plan"]["Plan Rows"])


def exact_statement(
    condition: ColumnElement[bool], vector: Sequence[float], limit: int, bound: int | None
) -> Select[Any]:
    """Every distance of the filtered set (of at most bound + 1 of its rows), then the nearest `limit` with
    what a result shows, and how many rows were scored. MATERIALIZED keeps the planner from answering the
    ORDER BY with the HNSW index, which would bring back the approximation."""
    distance = MemoryEntry.embedding.cosine_distance(vector)
    scored = select(MemoryEntry.id.label("entry_id"), distance.label("distance")).where(condition)
    if bound is not None:
        scored = scored.limit(bound + 1)
    scored_cte = scored.cte("scored").prefix_with("MATERIALIZED")
    nearest = (
        select(scored_cte.c.entry_id, scored_cte.c.distance)
        .order_by(scored_cte.c.distance, scored_cte.c.entry_id)
        .limit(limit)
        .subquery("nearest")
    )
    seen = select(func.count()).select_from(scored_cte).scalar_subquery()
    return (
        _with_details(select(nearest.c.distance, seen.label("seen")))
        .join(nearest, nearest.c.entry_id == MemoryEntry.id)
        .order_by(nearest.c.distance, MemoryEntry.id)
    )


async def _ranked_exactly(
    session: AsyncSession,
    condition: ColumnElement[bool],
    vector: Sequence[float],
    limit: int,
    bound: int | None,
) -> list[KnowledgeHit] | None:
    """The exact top `limit`; None when the set has more than `bound` rows."""
    rows = (await session.execute(exact_statement(condition, vector, limit, bound))).all()
    if bound is not None and rows and rows[0].seen > bound:
        return None
    return [_hit(row, row.distance) for row in rows]


def index_statement(condition: ColumnElement[bool], vector: Sequence[float], limit: int) -> Select[Any]:
    """The nearest `limit` through the HNSW index, with what a result shows. Ordering by the distance
    itself (here by its output name, so the vector is sent once) is what lets the planner use the index;
    the partial index also needs `invalidated_at IS NULL`, which the condition has."""
    distance = MemoryEntry.embedding.cosine_distance(vector).label("distance")
    return _with_details(select(distance)).where(condition).order_by(distance).limit(limit)


async def _indexed_rows(session: AsyncSession) -> float:
    """Rows in the table, all projects: the HNSW graph holds them all, so a filter's selectivity, and
    the walk it needs, is measured against this. The planner's own count, kept by ANALYZE."""
    rows = await session.scalar(text("SELECT reltuples FROM pg_class WHERE oid = 'memory_entries'::regclass"))
    return float(rows or 0.0)


async def _ranked_by_index(
    session: AsyncSession, condition: ColumnElement[bool], vector: Sequence[float], limit: int, ef_search: int
) -> list[KnowledgeHit]:
    """Nearest first, from an iterative HNSW scan.

    enable_sort = off leaves the ordered index scan as the only plan without a sort: the planner would
    otherwise sort a bitmap scan of a large set, which is the exact ranking at its slowest. The relaxed
    iterative scan returns rows slightly out of order, hence the sort here."""
    savepoint = await session.begin_nested()
    try:
        await session.execute(
            text(
                "SELECT set_config('hnsw.ef_search', :ef, true), "
                "set_config('hnsw.iterative_scan', 'relaxed_order', true), "
                "set_config('enable_sort', 'off', true)"
            ),
            {"ef": str(ef_search)},
        )
        rows = (await session.execute(index_statement(condition, vector, limit))).all()
    finally:
        await savepoint.rollback()
    return sorted(
        (_hit(row, row.distance) for row in rows), key=lambda hit: (-(hit.score or 0.0), hit.entry_id)
    )


def _with_details(ranked: Select[Any]) -> Select[Any]:
    """A statement's columns plus what a result shows of each entry: one round trip per search."""
    return ranked.add_columns(
        MemoryEntry.id,
        MemoryEntry.memory_id,
        Memory.name.label("memory_name"),
        MemoryEntry.content,
        MemoryEntry.tags,
        MemoryEntry.created_at,
        MemoryEntry.updated_at,
    ).join_from(MemoryEntry, Memory, Memory.id == MemoryEntry.memory_id)


def _hit(row: Any, distance: float | None) -> KnowledgeHit:
    return KnowledgeHit(
        entry_id=row.id,
        memory_id=row.memory_id,
        memory_name=row.memory_name,
        content=row.content,
        tags=row.tags,
        created_at=row.created_at,
        updated_at=row.updated_at,
        score=None if distance is None else 1.0 - float(distance),
    )


def _above(hits: list[KnowledgeHit], min_score: float | None) -> list[KnowledgeHit]:
    # Applied after ranking: a distance bound inside the index scan would make it walk on for rows
    # that can never pass.
    if min_score is None:
        return hits
    return [hit for hit in hits if hit.score is not None and hit.score >= min_score]
