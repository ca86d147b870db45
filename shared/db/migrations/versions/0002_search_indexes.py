"""Knowledge search: a trigram index that finds the entries whose own tags may match a glob.

A tag glob becomes a LIKE on each element of `tags`, which no array index can answer. The function below
joins an entry's tags, lower-cased, between separators; a trigram index on it narrows the candidates of
any glob with three literal characters, and the exact per-tag match (repository.tags_match_any) rechecks
them. Without it, a filter on a rare entry tag reads every entry of the project.

Search picks an exact ranking or the HNSW index from the planner's row estimate of the filtered set. The
planner ignores the statistics of a partial index's expression, so without the extended statistics below
it guesses one row in ten thousand for any tag glob, whatever the data.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # pg_trgm is a trusted extension (PostgreSQL 13+): a database owner may create it without superuser.
    op.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")
    # IMMUTABLE is true for text[] (array_to_string is only STABLE because of other element types) and is
    # what lets the index use it.
    op.execute(
        "CREATE OR REPLACE FUNCTION memory_tags_text(tags text[]) RETURNS text "
        "LANGUAGE sql IMMUTABLE PARALLEL SAFE "
        "AS $$ SELECT lower(E'\\x1f' || array_to_string(tags, E'\\x1f') || E'\\x1f') $$"
    )
    op.execute(
        "CREATE INDEX ix_entries_tags_trgm ON memory_entries "
        "USING gin (memory_tags_text(tags) gin_trgm_ops) WHERE invalidated_at IS NULL"
    )
    op.execute("CREATE STATISTICS st_entries_tags_text ON (memory_tags_text(tags)) FROM memory_entries")


def downgrade() -> None:
    op.execute("DROP STATISTICS IF EXISTS st_entries_tags_text")
    op.execute("DROP INDEX IF EXISTS ix_entries_tags_trgm")
    op.execute("DROP FUNCTION IF EXISTS memory_tags_text(text[])")
