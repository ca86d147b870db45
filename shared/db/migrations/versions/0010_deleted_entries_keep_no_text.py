"""A deleted entry keeps no text in its history.

`DELETE /memory-entries/{id}` is the way to remove an entry outright, yet its history (`entry_history`: every
decision that touched it, with the texts before and after, and the near-copies skipped against it) kept its texts,
for good, where no route can read them any more (an entry's history is a 404 once the entry is gone). The services
now clear those texts when they delete an entry or a memory; this clears what earlier deletions left. The rows
themselves stay, for audit: which write did what to which entry, and when.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(
        "UPDATE entry_history h SET content_before = NULL, content_after = NULL"
        " WHERE (h.content_before IS NOT NULL OR h.content_after IS NOT NULL)"
        " AND NOT EXISTS (SELECT 1 FROM memory_entries e WHERE e.id = h.entry_id)"
    )


def downgrade() -> None:
    pass  # the texts are gone; the schema did not change
