"""The model a decision, an extraction or a usage row names is stored whole.

Those columns held 255 characters, the length a model name may have when it is registered or sent. What is stored
is the name as litellm is asked for it, with the provider's prefix (`openai/…`): a name of 241 to 255 characters
then failed the write that merged through it, or the extraction, at its insert (a `DataError`), after the model had
answered and been paid. `varchar` to `text` is a change of type alone in PostgreSQL: no table is rewritten.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

COLUMNS = (("entry_history", True), ("generation_extractions", True), ("llm_usage", False))


def upgrade() -> None:
    for table, nullable in COLUMNS:
        op.alter_column(table, "model", type_=sa.Text(), existing_type=sa.String(255), existing_nullable=nullable)


def downgrade() -> None:
    # A longer name is cut to the old width: the older version cannot hold it.
    for table, nullable in COLUMNS:
        op.alter_column(
            table,
            "model",
            type_=sa.String(255),
            existing_type=sa.Text(),
            existing_nullable=nullable,
            postgresql_using="left(model, 255)",
        )
