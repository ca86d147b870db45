"""Tables. The schema itself is built by the Alembic migrations in shared/db/migrations, never create_all."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

import numpy as np
from pgvector.sqlalchemy import Vector
from sqlalchemy import BigInteger, DateTime, Float, ForeignKey, Identity, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import ARRAY, JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class BinaryVector(Vector):
    """pgvector's column type, with bound values handed to psycopg as float32 arrays: psycopg sends them in
    pgvector's binary form (its dumper is registered on each connection, shared.db.session). pgvector's own
    bind processor formats each float as text in Python (~0.17 ms for 384 dimensions) for PostgreSQL to parse."""

    cache_ok = True

    def bind_processor(self, dialect: Any) -> Any:
        def process(value: Any) -> np.ndarray | None:
            return None if value is None else np.asarray(value, dtype=np.float32)

        return process


class Base(DeclarativeBase):
    # Server defaults (timestamps) come back with INSERT … RETURNING instead of a second SELECT.
    __mapper_args__: ClassVar[dict[str, Any]] = {"eager_defaults": True}


def _created() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


def _stamped_at_the_statement() -> Mapped[datetime]:
    """The statement's time, not the transaction's (migration 0009): an entry written under its memory's lock
    is then stamped after every entry of that memory committed before it."""
    return mapped_column(DateTime(timezone=True), server_default=func.statement_timestamp(), nullable=False)


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(255))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class Memory(Base):
    __tablename__ = "memories"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    description: Mapped[str | None] = mapped_column(Text)
    tags: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    write_policy: Mapped[str] = mapped_column(String(32), server_default="seed")
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class MemoryEntry(Base):
    __tablename__ = "memory_entries"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    memory_id: Mapped[str] = mapped_column(ForeignKey("memories.id", ondelete="CASCADE"))
    # Denormalised from the memory (which never changes project) so isolation needs no join.
    project_id: Mapped[str] = mapped_column(String(32))
    content: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(64))
    # The dimension is fixed when the schema is first migrated (Settings.embedding_dimensions).
    # Deferred: parsing 384 floats per row is wasted on every read that only shows the entry.
    embedding: Mapped[list[float]] = mapped_column(BinaryVector(), deferred=True)
    embedding_model: Mapped[str] = mapped_column(String(255))
    source_type: Mapped[str] = mapped_column(String(32), server_default="manual")
    tags: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    metadata_: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    source_generation_id: Mapped[str | None] = mapped_column(String(255))
    source_conversation_id: Mapped[str | None] = mapped_column(String(255))
    invalidated_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    superseded_by_entry_id: Mapped[str | None] = mapped_column(
        ForeignKey("memory_entries.id", ondelete="SET NULL")
    )
    created_at: Mapped[datetime] = _stamped_at_the_statement()
    updated_at: Mapped[datetime] = _stamped_at_the_statement()


class WriteOutcome(Base):
    """One row per write id: the idempotency record, written in the decision's transaction."""

    __tablename__ = "write_outcomes"

    write_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(32))
    memory_id: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16))  # applied | failed
    action: Mapped[str | None] = mapped_column(String(16))
    entry_id: Mapped[str | None] = mapped_column(String(32))
    score: Mapped[float | None] = mapped_column(Float)
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_message: Mapped[str | None] = mapped_column(Text)
    failed_attempts: Mapped[int] = mapped_column(Integer, server_default="0")
    # The request that first claimed a client's Idempotency-Key (None without a key, and for the writer's
    # own records): a later request with the key must be the same request.
    request_hash: Mapped[str | None] = mapped_column(String(64))
    # When a pending write's event was seen on the stream (its caller timed out waiting: the 202): a retry of its
    # key then waits for it rather than publishing it again. None while not known to be published.
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class EntryHistory(Base):
    """Append-only audit of every decision that touched an entry."""

    __tablename__ = "entry_history"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    write_id: Mapped[str | None] = mapped_column(String(64))
    project_id: Mapped[str] = mapped_column(String(32))
    memory_id: Mapped[str] = mapped_column(String(32))
    entry_id: Mapped[str] = mapped_column(String(32))
    related_entry_id: Mapped[str | None] = mapped_column(String(32))
    action: Mapped[str] = mapped_column(String(16))
    rule: Mapped[str | None] = mapped_column(String(64))
    score: Mapped[float | None] = mapped_column(Float)
    candidate_ids: Mapped[list[str] | None] = mapped_column(ARRAY(Text))
    model: Mapped[str | None] = mapped_column(Text)
    prompt_version: Mapped[str | None] = mapped_column(String(32))
    content_before: Mapped[str | None] = mapped_column(Text)
    content_after: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _created()


class ApiKey(Base):
    """A project-scoped bearer credential. Only the secret's hash is kept; a revoked key stays, for audit."""

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str | None] = mapped_column(String(255))
    prefix: Mapped[str] = mapped_column(String(16))
    secret_hash: Mapped[str] = mapped_column(String(64))
    actions: Mapped[list[str]] = mapped_column(ARRAY(Text))
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class AiProvider(Base):
    """A project's LLM provider: a litellm prefix, an optional base URL and the NAME of the env variable
    holding its key (never the key)."""

    __tablename__ = "ai_providers"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    provider: Mapped[str] = mapped_column(String(64))
    api_base: Mapped[str | None] = mapped_column(Text)
    api_key_env: Mapped[str | None] = mapped_column(String(255))
    default_model: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class ModelRoute(Base):
    """Ordered targets (provider + model) tried in turn: failover."""

    __tablename__ = "model_routes"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(255))
    targets: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class ProjectSettings(Base):
    __tablename__ = "project_settings"

    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    default_model_route_id: Mapped[str | None] = mapped_column(ForeignKey("model_routes.id", ondelete="SET NULL"))
    updated_at: Mapped[datetime] = _created()


class ForgottenProvenance(Base):
    """A generation or conversation a project asked to forget, and when (the last time, if asked again): no
    write that cited it before then may reference it, not even one in flight when it was forgotten."""

    __tablename__ = "forgotten_provenance"

    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True)
    kind: Mapped[str] = mapped_column(String(16), primary_key=True)  # generation | conversation
    reference: Mapped[str] = mapped_column(String(255), primary_key=True)
    forgotten_at: Mapped[datetime] = _created()


class GenerationExtraction(Base):
    """The extraction outcome of one generation: pending → completed | skipped | failed."""

    __tablename__ = "generation_extractions"

    project_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    generation_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    status: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    candidates: Mapped[int] = mapped_column(Integer, server_default="0")
    created: Mapped[int] = mapped_column(Integer, server_default="0")
    updated: Mapped[int] = mapped_column(Integer, server_default="0")
    skipped: Mapped[int] = mapped_column(Integer, server_default="0")
    failed: Mapped[int] = mapped_column(Integer, server_default="0")
    model: Mapped[str | None] = mapped_column(Text)
    # The model's answer, stored before its facts are written: a redelivery writes these again (same write ids,
    # so nothing twice) instead of asking the model, which may word the facts differently.
    facts: Mapped[list[str] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = _created()
    updated_at: Mapped[datetime] = _created()


class LlmUsage(Base):
    """Tokens of every completion (extraction, merge, arbitration), for metering per project and provider."""

    __tablename__ = "llm_usage"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    project_id: Mapped[str] = mapped_column(String(32))
    ai_provider_id: Mapped[str | None] = mapped_column(String(32))
    model: Mapped[str] = mapped_column(Text)
    purpose: Mapped[str] = mapped_column(String(32))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = _created()
