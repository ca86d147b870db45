"""The facts a model extracted from a turn, kept before they are written, so a retry writes those, not new ones.

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: adding it rewrites nothing.
    op.add_column("generation_extractions", sa.Column("facts", JSONB, nullable=True))


def downgrade() -> None:
    op.drop_column("generation_extractions", "facts")
