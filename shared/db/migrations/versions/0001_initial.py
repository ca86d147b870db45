"""Projects, memories, entries with embeddings, write outcomes and the audit history.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from pgvector.sqlalchemy import Vector
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

from shared.settings import get_settings

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def _timestamps() -> list[sa.Column]:
    return [
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    ]


def upgrade() -> None:
    dimensions = get_settings().embedding_dimensions
    op.execute("CREATE EXTENSION IF NOT EXISTS vector")
    op.create_table(
        "projects",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(255), nullable=False),
        *_timestamps(),
    )
    op.create_table(
        "memories",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=False),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("description", sa.Text),
        sa.Column("tags", ARRAY(sa.Text)),
        sa.Column("write_policy", sa.String(32), nullable=False, server_default="seed"),
        *_timestamps(),
    )
    op.create_index("ix_memories_project_created", "memories", ["project_id", "created_at", "id"])
    op.create_table(
        "memory_entries",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("memory_id", sa.String(32), sa.ForeignKey("memories.id", ondelete="CASCADE"), nullable=False),
        sa.Column("project_id", sa.String(32), nullable=False),
        sa.Column("content", sa.Text, nullable=False),
        sa.Column("content_hash", sa.String(64), nullable=False),
        sa.Column("embedding", Vector(dimensions), nullable=False),
        sa.Column("embedding_model", sa.String(255), nullable=False),
        sa.Column("source_type", sa.String(32), nullable=False, server_default="manual"),
        sa.Column("tags", ARRAY(sa.Text)),
        sa.Column("metadata", JSONB),
        sa.Column("source_generation_id", sa.String(255)),
        sa.Column("source_conversation_id", sa.String(255)),
        sa.Column("invalidated_at", sa.DateTime(timezone=True)),
        sa.Column(
            "superseded_by_entry_id",
            sa.String(32),
            sa.ForeignKey("memory_entries.id", ondelete="SET NULL"),
        ),
        *_timestamps(),
    )
    op.create_index("ix_entries_memory_created", "memory_entries", ["memory_id", "created_at", "id"])
    op.create_index("ix_entries_project_created", "memory_entries", ["project_id", "created_at", "id"])
    op.create_index(
        "ix_entries_valid_hash",
        "memory_entries",
        ["memory_id", "content_hash"],
        postgresql_where=sa.text("invalidated_at IS NULL"),
    )
    op.create_index("ix_entries_generation", "memory_entries", ["source_generation_id"])
    op.create_index("ix_entries_conversation", "memory_entries", ["source_conversation_id"])
    # Only valid entries are ever searched or deduplicated against, so the ANN index skips the rest.
    op.execute(
        "CREATE INDEX ix_entries_embedding_hnsw ON memory_entries "
        "USING hnsw (embedding vector_cosine_ops) WITH (m = 16, ef_construction = 64) "
        "WHERE invalidated_at IS NULL"
    )
    op.create_table(
        "write_outcomes",
        sa.Column("write_id", sa.String(64), primary_key=True),
        sa.Column("project_id", sa.String(32), nullable=False),
        sa.Column("memory_id", sa.String(32), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("action", sa.String(16)),
        sa.Column("entry_id", sa.String(32)),
        sa.Column("score", sa.Float),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        sa.Column("failed_attempts", sa.Integer, nullable=False, server_default="0"),
        *_timestamps(),
    )
    op.create_table(
        "entry_history",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("write_id", sa.String(64)),
        sa.Column("project_id", sa.String(32), nullable=False),
        sa.Column("memory_id", sa.String(32), nullable=False),
        sa.Column("entry_id", sa.String(32), nullable=False),
        sa.Column("related_entry_id", sa.String(32)),
        sa.Column("action", sa.String(16), nullable=False),
        sa.Column("rule", sa.String(64)),
        sa.Column("score", sa.Float),
        sa.Column("candidate_ids", ARRAY(sa.Text)),
        sa.Column("model", sa.String(255)),
        sa.Column("prompt_version", sa.String(32)),
        sa.Column("content_before", sa.Text),
        sa.Column("content_after", sa.Text),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_history_entry", "entry_history", ["entry_id", "id"])


def downgrade() -> None:
    for table in ("entry_history", "write_outcomes", "memory_entries", "memories", "projects"):
        op.drop_table(table)
