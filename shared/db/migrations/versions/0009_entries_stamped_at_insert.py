"""An entry's `created_at` and `updated_at` are the time of the statement that writes them, not of its transaction.

`now()` is when the transaction began. A writer's batch begins, then waits for its memories' locks (taken in one
order); while it waits for one, another write may commit to a memory it locks next. The batch's entry there then
committed after that write with an earlier `created_at`, and a client paging through the memory by `created_at`
had already passed its place. `statement_timestamp()`, the start of the INSERT, which is sent once the memory's
lock is held, orders a memory's entries as their writes committed, and gives both columns of a new entry the same
time (`clock_timestamp()` would stamp them a microsecond apart, and a fresh entry would look edited). A metadata
change only: existing rows keep their times.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    for column in ("created_at", "updated_at"):
        op.alter_column("memory_entries", column, server_default=sa.text("statement_timestamp()"))


def downgrade() -> None:
    for column in ("created_at", "updated_at"):
        op.alter_column("memory_entries", column, server_default=sa.text("now()"))
