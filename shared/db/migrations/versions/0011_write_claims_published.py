"""A pending write records that its event was published.

A retry of an Idempotency-Key whose claim was older than 30 s took the write over and published it again. When
the first event was still queued (no writer running), the stream dropped the copy only within its duplicate window
(2 minutes); after it, every retry queued one more copy, which the writer then skipped as a replay. A claim whose
event is known to be on the stream is now awaited, not taken over, unless it is very old (`STALE_PUBLISHED`).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("write_outcomes", sa.Column("published_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    op.drop_column("write_outcomes", "published_at")
