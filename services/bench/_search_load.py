"""Loading the search benchmark's corpus: embedded once, COPYed into its own project, reused when present."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import numpy as np
import psycopg
from pgvector.psycopg import register_vector

from services.bench._search_corpus import Entry, Fact, HashedEmbedder, corpus, memory_tags
from shared.guard import content_hash
from shared.ids import ENTRY_PREFIX, MEMORY_PREFIX, PROJECT_PREFIX, new_id

REBUILT_INDEXES = ("ix_entries_embedding_hnsw", "ix_entries_tags_trgm")
EMBED_BATCH = 512


@dataclass
class BenchEmbedder:
    """What embeds the corpus and the queries; `model` is what the API process is configured with."""

    model: str
    label: str
    embed: Callable[[list[str]], np.ndarray]


def minilm_embedder() -> BenchEmbedder:
    from shared.embeddings import LOCAL_DIMENSIONS, LOCAL_MODEL, embed_texts

    def embed(texts: list[str]) -> np.ndarray:
        async def batches() -> list[list[float]]:
            vectors: list[list[float]] = []
            for start in range(0, len(texts), EMBED_BATCH):
                batch = texts[start : start + EMBED_BATCH]
                vectors += await embed_texts(batch, model=LOCAL_MODEL, dimensions=LOCAL_DIMENSIONS)
            return vectors

        return np.asarray(asyncio.run(batches()), dtype=np.float32)

    return BenchEmbedder(LOCAL_MODEL, f"{LOCAL_MODEL} (all-MiniLM-L6-v2 int8, the default model)", embed)


def hashed_embedder() -> BenchEmbedder:
    """The stand-in, registered with litellm as `bench/…` so the API embeds queries with it too."""
    from litellm.llms.custom_llm import CustomLLM
    from litellm.types.utils import EmbeddingResponse

    from shared.embeddings import register_local_provider
    from shared.embeddings._provider import litellm  # first: it keeps litellm from fetching a cost map

    stand_in = HashedEmbedder()

    class Handler(CustomLLM):
        async def aembedding(
            self, model: str, input: list[Any], model_response: EmbeddingResponse, *args: Any, **kwargs: Any
        ) -> EmbeddingResponse:
            vectors = stand_in.embed([str(text) for text in input])
            model_response.data = [
                {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)
            ]
            return model_response

    register_local_provider()
    # Keep the "local" provider registered beside ours (litellm's stubs do not declare the map).
    current = getattr(litellm, "custom_provider_map", None) or []
    others = [p for p in current if p.get("provider") != "bench"]
    handlers = [*others, {"provider": "bench", "custom_handler": Handler()}]
    litellm.custom_provider_map = handlers  # type: ignore[attr-defined]
    return BenchEmbedder(
        f"bench/{stand_in.name}",
        f"{stand_in.name} (deterministic stand-in, not a language model)",
        stand_in.embed,
    )


@dataclass
class LoadedCorpus:
    project_id: str
    memory_ids: list[str]
    facts: list[Fact]
    entries: list[Entry]
    reused: bool
    seconds: dict[str, float] = field(default_factory=dict)


def _connect(database_url: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True)
    register_vector(conn)
    return conn


def load(
    database_url: str,
    *,
    entries: int,
    memories: int,
    seed: int,
    embedder: BenchEmbedder,
    rebuild_indexes: bool,
) -> LoadedCorpus:
    """The corpus in a project of its own, named after what shaped it, so a second run with the same
    arguments reuses it. `rebuild_indexes` (only on a server the benchmark owns) drops the search indexes
    for the COPY and builds them again with the migrations' very definitions, as a bulk load would."""
    facts, rows = corpus(entries, memories, seed)
    name = f"bench-search n={entries} memories={memories} seed={seed} model={embedder.model}"
    with _connect(database_url) as conn:
        found = conn.execute(
            "SELECT p.id, (SELECT count(*) FROM memory_entries e WHERE e.project_id = p.id) FROM projects p "
            "WHERE p.name = %s",
            (name,),
        ).fetchone()
        if found is not None and found[1] == entries:
            memory_ids = [
                r[0]
                for r in conn.execute(
                    "SELECT id FROM memories WHERE project_id = %s ORDER BY name", (found[0],)
                )
            ]
            return LoadedCorpus(found[0], memory_ids, facts, rows, reused=True)
        if found is not None:  # an interrupted load
            conn.execute("DELETE FROM projects WHERE id = %s", (found[0],))
            conn.execute("DELETE FROM memory_entries WHERE project_id = %s", (found[0],))

        seconds: dict[str, float] = {}
        started = time.perf_counter()
        print(f"embedding {len(rows):,} entries with {embedder.model} …", file=sys.stderr, flush=True)
        vectors = embedder.embed([row.content for row in rows])
        seconds["embed"] = time.perf_counter() - started

        started = time.perf_counter()
        project_id = new_id(PROJECT_PREFIX)
        memory_ids = [new_id(MEMORY_PREFIX) for _ in range(memories)]
        conn.execute("INSERT INTO projects (id, name) VALUES (%s, %s)", (project_id, name))
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO memories (id, project_id, name, tags) VALUES (%s, %s, %s, %s)",
                [(mid, project_id, f"Account {i:03d}", memory_tags(i)) for i, mid in enumerate(memory_ids)],
            )
        definitions = _drop_search_indexes(conn) if rebuild_indexes else []
        _copy_entries(conn, project_id, memory_ids, rows, vectors, embedder.model)
        seconds["copy"] = time.perf_counter() - started

        started = time.perf_counter()
        print("building the search indexes …", file=sys.stderr, flush=True)
        conn.execute("SET maintenance_work_mem = '2GB'")
        for definition in definitions:
            conn.execute(definition)
        conn.execute("VACUUM ANALYZE memory_entries")
        conn.execute("VACUUM ANALYZE memories")
        seconds["index"] = time.perf_counter() - started
    return LoadedCorpus(project_id, memory_ids, facts, rows, reused=False, seconds=seconds)


def _drop_search_indexes(conn: psycopg.Connection[Any]) -> list[str]:
    definitions = [
        r[0]
        for r in conn.execute(
            "SELECT indexdef FROM pg_indexes WHERE tablename = 'memory_entries' AND indexname = ANY(%s) "
            "ORDER BY indexname",
            (list(REBUILT_INDEXES),),
        )
    ]
    for index in REBUILT_INDEXES:
        conn.execute(f"DROP INDEX IF EXISTS {index}")
    return definitions


def _copy_entries(
    conn: psycopg.Connection[Any],
    project_id: str,
    memory_ids: list[str],
    rows: list[Entry],
    vectors: np.ndarray,
    model: str,
) -> None:
    # Distinct creation times keep the listing order (created_at, then id) that of the corpus.
    epoch = datetime(2026, 1, 1, tzinfo=UTC)
    columns = "id, memory_id, project_id, content, content_hash, embedding, embedding_model, tags, created_at, updated_at"
    with (
        conn.cursor() as cur,
        cur.copy(f"COPY memory_entries ({columns}) FROM STDIN WITH (FORMAT BINARY)") as copy,
    ):
        copy.set_types(
            [
                "varchar",
                "varchar",
                "varchar",
                "text",
                "varchar",
                "vector",
                "varchar",
                "text[]",
                "timestamptz",
                "timestamptz",
            ]
        )
        for i, (row, vector) in enumerate(zip(rows, vectors, strict=True)):
            at = epoch + timedelta(milliseconds=i)
            copy.write_row(
                [
                    new_id(ENTRY_PREFIX),
                    memory_ids[row.memory],
                    project_id,
                    row.content,
                    content_hash(row.content),
                    vector,
                    model,
                    row.tags,
                    at,
                    at,
                ]
            )
