"""Filtering must not ruin recall: a memory of 200 entries among 20,000 others returns its true top 10.

The corpus lives in a database of its own on the test server, so its 20,000 rows neither slow the other
tests' index scans nor need vacuuming away: it is built once for this module (COPY, then the migrations'
own index definitions rebuilt, as a bulk load would) and dropped at the end. The truth is computed in numpy
from the very vectors inserted, independently of the database.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
import pytest
import pytest_asyncio
from pgvector.psycopg import register_vector
from psycopg import sql
from sqlalchemy import make_url, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared.db.migrate import upgrade
from shared.db.session import create_engine, session_factory
from shared.ids import ENTRY_PREFIX, MEMORY_PREFIX, PROJECT_PREFIX, new_id
from shared.search import KnowledgeFilter, SearchPath, search_by_vector

DIMENSIONS = 384
OTHER_MEMORIES, PER_MEMORY = 100, 200
TOPICS, SUBTOPICS = 20, 15
RARE_TAGGED = 150
QUERIES = 20
TIE = 1e-5  # float4 storage and accumulation: scores this close may swap places


@dataclass
class Corpus:
    sessions: async_sessionmaker[AsyncSession]
    project_id: str
    target_memory: str
    ids: np.ndarray  # entry ids, aligned with vectors
    vectors: np.ndarray
    memory_of: np.ndarray  # index of each entry's memory; 0 is the target
    valid: np.ndarray  # False for the invalidated entries
    rare: np.ndarray  # True for the entries tagged flag:rare
    bulk: np.ndarray  # True for the entries tagged source:bulk (about half)
    queries: np.ndarray


def _unit(rows: np.ndarray) -> np.ndarray:
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float32)


def _clustered(rng: np.random.Generator, count: int) -> np.ndarray:
    """Unit vectors around topics and their subtopics, so that similarity is graded as between texts.
    The caller seeds the generator: the same corpus and queries on every run."""
    topics = _unit(rng.standard_normal((TOPICS, DIMENSIONS)))
    subtopics = _unit(rng.standard_normal((TOPICS * SUBTOPICS, DIMENSIONS)))
    which = rng.integers(0, TOPICS * SUBTOPICS, count)
    noise = _unit(rng.standard_normal((count, DIMENSIONS)))
    return _unit(topics[which // SUBTOPICS] + 0.7 * subtopics[which] + 0.6 * noise)


def _build(conninfo: str, rng: np.random.Generator) -> dict[str, Any]:
    count = (OTHER_MEMORIES + 1) * PER_MEMORY
    # Every memory draws from every topic: a query's global neighbours are nearly all other memories'.
    vectors = _clustered(rng, count + QUERIES)
    vectors, queries = vectors[:count], vectors[count:]
    memory_of = np.repeat(np.arange(OTHER_MEMORIES + 1), PER_MEMORY)
    valid = np.ones(count, dtype=bool)
    valid[rng.choice(np.flatnonzero(memory_of == 0), 20, replace=False)] = False
    rare = np.zeros(count, dtype=bool)
    rare[rng.choice(np.flatnonzero(memory_of != 0), RARE_TAGGED, replace=False)] = True
    bulk = rng.random(count) < 0.5
    ids = np.array([new_id(ENTRY_PREFIX) for _ in range(count)])
    project_id = new_id(PROJECT_PREFIX)
    memory_ids = [new_id(MEMORY_PREFIX) for _ in range(OTHER_MEMORIES + 1)]
    with psycopg.connect(conninfo, autocommit=True) as conn:
        register_vector(conn)
        conn.execute("INSERT INTO projects (id, name) VALUES (%s, 'recall')", (project_id,))
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO memories (id, project_id, name) VALUES (%s, %s, %s)",
                [(memory_id, project_id, f"memory {i}") for i, memory_id in enumerate(memory_ids)],
            )
        rebuilt = [
            row[0]
            for row in conn.execute(
                "SELECT indexdef FROM pg_indexes "
                "WHERE tablename = 'memory_entries' AND indexdef ILIKE '%using hnsw%'"
            )
        ]
        for definition in rebuilt:
            conn.execute("DROP INDEX " + definition.split(" INDEX ", 1)[1].split(" ON ", 1)[0])
        columns = "id, memory_id, project_id, content, content_hash, embedding, embedding_model, tags, invalidated_at"
        with conn.cursor() as cur, cur.copy(f"COPY memory_entries ({columns}) FROM STDIN") as copy:
            for i in range(count):
                tags = ["flag:rare"] if rare[i] else []
                tags += ["source:bulk"] if bulk[i] else []
                copy.write_row(
                    [
                        ids[i],
                        memory_ids[memory_of[i]],
                        project_id,
                        f"entry {i}",
                        f"{i:064x}",
                        vectors[i],
                        "synthetic",
                        tags or None,
                        None if valid[i] else "2026-01-01T00:00:00Z",
                    ]
                )
        for definition in rebuilt:
            conn.execute(definition)
        conn.execute("ANALYZE memory_entries")
    return {
        "project_id": project_id,
        "target_memory": memory_ids[0],
        "ids": ids,
        "vectors": vectors,
        "memory_of": memory_of,
        "valid": valid,
        "rare": rare,
        "bulk": bulk,
        "queries": queries,
    }


@pytest.fixture(scope="module")
def recall_database(server_urls: tuple[str, str]) -> Iterator[str]:
    url = make_url(server_urls[0])
    name = f"memories_recall_{secrets.token_hex(4)}"
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        except psycopg.errors.InsufficientPrivilege:
            pytest.skip("the test database's user may not create a database for the 20,000-entry corpus")
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest_asyncio.fixture(scope="module")
async def corpus(recall_database: str) -> AsyncIterator[Corpus]:
    upgrade(recall_database)
    built = _build(
        make_url(recall_database).set(drivername="postgresql").render_as_string(hide_password=False),
        np.random.default_rng(20_000),
    )
    engine = create_engine(recall_database, pool_size=2)
    yield Corpus(sessions=session_factory(engine), **built)
    await engine.dispose()


def true_scores(corpus: Corpus, query: np.ndarray, among: np.ndarray) -> dict[str, float]:
    scores = corpus.vectors[among].astype(np.float64) @ query.astype(np.float64)
    return dict(zip(corpus.ids[among].tolist(), scores.tolist(), strict=True))


def recall_at_10(found: list[str], truth: dict[str, float]) -> float:
    """Found ids that belong in the true top 10 (up to float ties), over 10."""
    tenth = sorted(truth.values(), reverse=True)[9]
    return sum(1 for entry_id in found if truth.get(entry_id, -2.0) >= tenth - TIE) / 10


async def run(
    corpus: Corpus, query: np.ndarray, filters: KnowledgeFilter, **options: Any
) -> tuple[list[str], SearchPath]:
    async with corpus.sessions() as session:
        found = await search_by_vector(
            session, project_id=corpus.project_id, vector=query.tolist(), filters=filters, limit=10, **options
        )
    scores = [hit.score for hit in found.hits]
    assert scores == sorted(scores, reverse=True)  # type: ignore[type-var]
    return [hit.entry_id for hit in found.hits], found.path


async def test_a_memory_of_200_among_20000_returns_its_true_top_10(corpus: Corpus) -> None:
    target = KnowledgeFilter(memory_ids=[corpus.target_memory])
    among = corpus.valid & (corpus.memory_of == 0)
    for query in corpus.queries:
        found, path = await run(corpus, query, target)
        assert path is SearchPath.EXACT and recall_at_10(found, true_scores(corpus, query, among)) == 1.0


async def test_the_iterative_index_scan_alone_keeps_recall_on_that_memory(corpus: Corpus) -> None:
    target = KnowledgeFilter(memory_ids=[corpus.target_memory])
    among = corpus.valid & (corpus.memory_of == 0)
    recalls, paths = [], set()
    for query in corpus.queries:
        found, path = await run(corpus, query, target, exact_scan_max=0)
        recalls.append(recall_at_10(found, true_scores(corpus, query, among)))
        paths.add(path)
    assert SearchPath.INDEX in paths and float(np.mean(recalls)) >= 0.9, (paths, recalls)


async def test_a_plain_index_scan_would_lose_them(corpus: Corpus) -> None:
    """The control: what the filter does to a non-iterative HNSW scan, i.e. why the search avoids one."""
    returned = []
    async with corpus.sessions() as session:
        await session.execute(text("SET LOCAL hnsw.iterative_scan = off"))
        await session.execute(text("SET LOCAL enable_sort = off"))  # the index, not a sort of the memory
        for query in corpus.queries:
            rows = await session.execute(
                text(
                    "SELECT id FROM memory_entries WHERE memory_id = :memory AND invalidated_at IS NULL "
                    "ORDER BY embedding <=> CAST(:query AS vector) LIMIT 10"
                ),
                {"memory": corpus.target_memory, "query": str(query.tolist())},
            )
            returned.append(len(rows.all()))
    assert float(np.mean(returned)) < 5, returned


async def test_unfiltered_search_goes_through_the_index_with_high_recall(corpus: Corpus) -> None:
    recalls = []
    for query in corpus.queries:
        found, path = await run(corpus, query, KnowledgeFilter())
        assert path is SearchPath.INDEX
        recalls.append(recall_at_10(found, true_scores(corpus, query, corpus.valid)))
    assert float(np.mean(recalls)) >= 0.95, recalls


async def test_entry_tag_filters_rare_and_broad(corpus: Corpus) -> None:
    rare, broad = [], []
    for query in corpus.queries:
        found, path = await run(corpus, query, KnowledgeFilter(tag_patterns=["FLAG:r?re"]))
        assert path is SearchPath.EXACT
        rare.append(recall_at_10(found, true_scores(corpus, query, corpus.valid & corpus.rare)))
        found, path = await run(corpus, query, KnowledgeFilter(tag_patterns=["source:*"]))
        assert path is SearchPath.INDEX
        broad.append(recall_at_10(found, true_scores(corpus, query, corpus.valid & corpus.bulk)))
    assert rare == [1.0] * QUERIES and float(np.mean(broad)) >= 0.95, broad


async def test_the_index_settings_do_not_outlive_the_search(corpus: Corpus) -> None:
    async with corpus.sessions() as session:
        settings_now = text(
            "SELECT current_setting('enable_sort'), current_setting('hnsw.iterative_scan', true)"
        )
        before = tuple((await session.execute(settings_now)).one())
        await search_by_vector(
            session,
            project_id=corpus.project_id,
            vector=corpus.queries[0].tolist(),
            filters=KnowledgeFilter(),
            limit=10,
        )
        after = tuple((await session.execute(settings_now)).one())
        assert after == before
