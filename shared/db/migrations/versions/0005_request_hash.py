"""The fingerprint of the request that first used an Idempotency-Key, so a reuse for another write is refused.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Nullable and without a default: adding it rewrites nothing, and records from before it are not compared.
    op.add_column("write_outcomes", sa.Column("request_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    op.drop_column("write_outcomes", "request_hash")
