"""`memories bench search`: search latency and recall at scale, printed as a markdown table.

Loads N entries (default 100,000; 384-d) of paraphrased facts into a project of their own, embedded by the
default model (all-MiniLM-L6-v2 int8, ~5.5 minutes for 100k on 2 cores) or, with `--embedder hashed`, by a
deterministic bag-of-words stand-in that takes seconds and that the table names. Then, for unfiltered
queries and for queries filtered to one memory or to one tag, it measures:

- latency directly against the database: `shared.search.search_by_vector` on a vector embedded beforehand,
  every statement a search runs (resolving the filters, the planner's estimate, the ranking, the rows);
- latency through the HTTP API: `POST /api/v1/knowledge/search` with the query text, on a uvicorn server in
  this process, so the query is embedded by the same model as the corpus;
- recall@10 of each search against the exact ranking of the same filtered set.

It starts its own PostgreSQL and NATS unless DATABASE_URL / NATS_URL are set. With `--data-dir` the
embedded servers keep their data there and a second run with the same arguments reuses the loaded corpus.
Not a test: it asserts nothing, it reports. See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from services.bench._search_load import BenchEmbedder, LoadedCorpus, hashed_embedder, load, minilm_embedder
from shared.search import (
    EXACT_SCAN_MAX,
    KnowledgeFilter,
    KnowledgeHit,
    ef_search_for,
    entry_condition,
    search_by_vector,
)
from shared.settings import Settings, get_settings

BENCH_TOKEN = "bench-search-admin-token"
TIE = 1e-6


@dataclass
class Case:
    name: str
    filters: list[KnowledgeFilter]  # one per query
    http: bool = True
    exact_scan_max: int = EXACT_SCAN_MAX
    sql_ms: list[float] = field(default_factory=list)
    http_ms: list[float] = field(default_factory=list)
    recalls: list[float] = field(default_factory=list)
    paths: dict[str, int] = field(default_factory=dict)
    estimates: list[float] = field(default_factory=list)
    rows: float = 0.0  # the filtered set's true size (median over the filters of the case)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="memories bench search",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--entries", type=int, default=100_000, help="corpus size (default 100000)")
    parser.add_argument("--memories", type=int, default=100, help="memories the corpus is spread over")
    parser.add_argument("--queries", type=int, default=200, help="queries per case (default 200)")
    parser.add_argument(
        "--embedder",
        choices=("minilm", "hashed"),
        default="minilm",
        help="minilm: the default model (real, slow to load); hashed: the stand-in (fast)",
    )
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--data-dir", type=Path, help="keep the embedded servers' data here and reuse it")
    parser.add_argument(
        "--shared-buffers",
        default="1GB",
        help="shared_buffers of the embedded PostgreSQL (default 1GB: table and index fit)",
    )
    parser.add_argument("--no-http", action="store_true", help="measure only directly against the database")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    settings = get_settings()
    embedder = minilm_embedder() if args.embedder == "minilm" else hashed_embedder()
    with ExitStack() as stack:
        root = args.data_dir or Path(stack.enter_context(_temporary_dir()))
        database_url, nats_url, own_postgres = _servers(stack, settings, root, args)
        from shared.db.migrate import upgrade

        upgrade(database_url)
        corpus = load(
            database_url,
            entries=args.entries,
            memories=args.memories,
            seed=args.seed,
            embedder=embedder,
            rebuild_indexes=own_postgres,
        )
        texts, cases = _cases(corpus, args.queries, args.seed)
        load_before = os.getloadavg()[0]
        vectors = embedder.embed(texts)
        facts = asyncio.run(_measure_sql(database_url, corpus.project_id, vectors, cases))
        if not args.no_http:
            api_settings = Settings(
                database_url=database_url,
                nats_url=nats_url,
                memories_admin_token=BENCH_TOKEN,
                embedding_model=embedder.model,
            )
            with _api_server(api_settings) as base_url:
                _measure_http(base_url, corpus.project_id, texts, cases)
        facts["load"] = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after the measurements"
        print(_report(args, embedder, corpus, facts, cases))
    return 0


@contextmanager
def _temporary_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="memories-bench-search-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _servers(
    stack: ExitStack, settings: Settings, root: Path, args: argparse.Namespace
) -> tuple[str, str, bool]:
    from shared.servers import EmbeddedNats, EmbeddedPostgres

    database_url, nats_url = settings.database_url, settings.nats_url
    own_postgres = database_url is None
    if database_url is None:
        postgres = EmbeddedPostgres(
            root / "postgres", extra_args=["-c", f"shared_buffers={args.shared_buffers}"]
        )
        database_url = postgres.start()
        stack.callback(postgres.stop)
    if nats_url is None and not args.no_http:
        nats_server = EmbeddedNats(root / "nats")
        nats_url = nats_server.start()
        stack.callback(nats_server.stop)
    return database_url, nats_url or "", own_postgres


def _cases(corpus: LoadedCorpus, count: int, seed: int) -> tuple[list[str], list[Case]]:
    """Questions about stored facts; 'one memory' filters each to the memory that holds its fact, as an
    agent whose memory it is would."""
    rng = random.Random(seed + 2)
    memory_of_fact = {entry.fact: corpus.memory_ids[entry.memory] for entry in corpus.entries}
    asked = [rng.choice(sorted(memory_of_fact)) for _ in range(count)]
    texts = [corpus.facts[fact].question(rng.randrange(2)) for fact in asked]
    own = [KnowledgeFilter(memory_ids=[memory_of_fact[fact]]) for fact in asked]

    def same(filters: KnowledgeFilter) -> list[KnowledgeFilter]:
        return [filters] * count

    return texts, [
        Case("no filter", same(KnowledgeFilter())),
        Case("one memory (memory_ids)", own),
        Case("one memory, index forced", own, http=False, exact_scan_max=0),
        Case("one memory tag (`region:emea`)", same(KnowledgeFilter(tag_patterns=["region:emea"]))),
        Case("one entry tag (`source:ticket`)", same(KnowledgeFilter(tag_patterns=["source:ticket"]))),
        Case("one rare entry tag (`flag:escalated`)", same(KnowledgeFilter(tag_patterns=["flag:escalated"]))),
    ]


def _recall(found: list[KnowledgeHit], truth: list[KnowledgeHit]) -> float:
    """Share of the exact top 10 found; a hit that ties the 10th score counts as one of them."""
    if not truth:
        return 1.0
    wanted = {hit.entry_id for hit in truth}
    tenth = min(hit.score or 0.0 for hit in truth)
    good = sum(1 for hit in found if hit.entry_id in wanted or (hit.score or -2.0) >= tenth - TIE)
    return min(good, len(truth)) / len(truth)


async def _measure_sql(
    database_url: str, project_id: str, vectors: np.ndarray, cases: list[Case]
) -> dict[str, str]:
    from sqlalchemy import text

    from shared.db.session import create_engine, session_factory

    engine = create_engine(database_url, pool_size=2)
    sessions = session_factory(engine)
    try:
        async with sessions() as session:
            facts = {
                "postgres": str(await session.scalar(text("SHOW server_version"))),
                "pgvector": str(
                    await session.scalar(text("SELECT extversion FROM pg_extension WHERE extname = 'vector'"))
                ),
                "shared_buffers": str(await session.scalar(text("SHOW shared_buffers"))),
            }
        for case in cases:
            case.rows = await _filtered_rows(sessions, project_id, case.filters)
            for warm_up in (True, False):  # the first pass loads the pages a case touches
                for vector, filters in zip(vectors, case.filters, strict=True):
                    query = [float(x) for x in vector]
                    async with sessions() as session:
                        started = time.perf_counter()
                        found = await search_by_vector(
                            session,
                            project_id=project_id,
                            vector=query,
                            filters=filters,
                            limit=10,
                            exact_scan_max=case.exact_scan_max,
                        )
                        elapsed = (time.perf_counter() - started) * 1000
                    if warm_up:
                        continue
                    async with sessions() as session:
                        truth = await search_by_vector(
                            session,
                            project_id=project_id,
                            vector=query,
                            filters=filters,
                            limit=10,
                            exact_scan_max=10**12,
                        )
                    case.sql_ms.append(elapsed)
                    case.recalls.append(_recall(found.hits, truth.hits))
                    case.paths[found.path.value] = case.paths.get(found.path.value, 0) + 1
                    case.estimates.append(found.estimate or 0.0)
    finally:
        await engine.dispose()
    return facts


async def _filtered_rows(sessions: Any, project_id: str, filters: list[KnowledgeFilter]) -> float:
    from sqlalchemy import func, select

    from shared.db.models import MemoryEntry

    distinct = {(tuple(f.memory_ids), tuple(f.tag_patterns)): f for f in filters}
    counts = []
    for filters_of_query in list(distinct.values())[:20]:
        async with sessions() as session:
            condition = await entry_condition(session, project_id, filters_of_query)
            if condition is None:
                counts.append(0.0)
                continue
            counted = select(func.count()).select_from(MemoryEntry).where(condition)
            counts.append(float(await session.scalar(counted) or 0))
    return float(np.median(counts))


@contextmanager
def _api_server(settings: Settings) -> Iterator[str]:
    from services.api.serving import serve_in_thread

    with serve_in_thread(settings) as url:
        yield f"{url}/api/v1"


def _measure_http(base_url: str, project_id: str, texts: list[str], cases: list[Case]) -> None:
    headers = {"Authorization": f"Bearer {BENCH_TOKEN}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        for case in (c for c in cases if c.http):
            for warm_up in (True, False):
                for query, filters in zip(texts, case.filters, strict=True):
                    body: dict[str, Any] = {
                        "project_id": project_id,
                        "query": query,
                        "limit": 10,
                        "memory_ids": list(filters.memory_ids),
                        "memory_tags": list(filters.tag_patterns),
                    }
                    started = time.perf_counter()
                    response = client.post("/knowledge/search", json=body)
                    elapsed = (time.perf_counter() - started) * 1000
                    response.raise_for_status()
                    if not warm_up:
                        case.http_ms.append(elapsed)


def _ms(values: list[float], percentile: float) -> str:
    return f"{np.percentile(values, percentile):.1f}" if values else "–"


def _report(
    args: argparse.Namespace,
    embedder: BenchEmbedder,
    corpus: LoadedCorpus,
    facts: dict[str, str],
    cases: list[Case],
) -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    load_note = (
        "reused from an earlier run"
        if corpus.reused
        else ", ".join(f"{step} {seconds:.0f} s" for step, seconds in corpus.seconds.items())
    )
    lines = [
        (
            f"Search benchmark, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {args.entries:,} entries in "
            f"{args.memories} memories, {args.queries} queries per case."
        ),
        (
            f"Machine: {len(os.sched_getaffinity(0))} cores ({cpu}); PostgreSQL {facts['postgres']}, "
            f"pgvector {facts['pgvector']}, shared_buffers {facts['shared_buffers']}. "
            f"Load average (1 min): {facts['load']}."
        ),
        f"Embedder: {embedder.label}. Corpus load: {load_note}.",
        (
            f"HNSW m=16, ef_construction=64; limit 10; hnsw.ef_search {ef_search_for(10)} unfiltered, more for "
            f"filters (shared.search.ef_search_for); exact ranking up to {EXACT_SCAN_MAX:,} estimated rows."
        ),
        "",
        (
            "| case | filtered rows (planner's estimate) | path taken | recall@10 | SQL p50 ms | SQL p95 ms "
            "| HTTP p50 ms | HTTP p95 ms |"
        ),
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for case in cases:
        paths = ", ".join(f"{path} {count}" for path, count in sorted(case.paths.items()))
        lines.append(
            f"| {case.name} | {case.rows:,.0f} ({np.median(case.estimates):,.0f}) | {paths} "
            f"| {np.mean(case.recalls):.3f} "
            f"| {_ms(case.sql_ms, 50)} | {_ms(case.sql_ms, 95)} "
            f"| {_ms(case.http_ms, 50)} | {_ms(case.http_ms, 95)} |"
        )
    return "\n".join(lines)
