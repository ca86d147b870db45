"""AI providers, model routes, per-project default route, extraction outcomes and LLM usage.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def _timestamps() -> list[sa.Column]:
    return [
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    ]


def _project() -> sa.Column:
    return sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id", ondelete="CASCADE"), nullable=False)


def upgrade() -> None:
    op.create_table(
        "ai_providers",
        sa.Column("id", sa.String(32), primary_key=True),
        _project(),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("provider", sa.String(64), nullable=False),
        sa.Column("api_base", sa.Text),
        sa.Column("api_key_env", sa.String(255)),
        sa.Column("default_model", sa.String(255)),
        *_timestamps(),
    )
    op.create_index("ix_ai_providers_project", "ai_providers", ["project_id", "created_at", "id"])
    op.create_table(
        "model_routes",
        sa.Column("id", sa.String(32), primary_key=True),
        _project(),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("targets", JSONB, nullable=False),
        *_timestamps(),
    )
    op.create_index("ix_model_routes_project", "model_routes", ["project_id", "created_at", "id"])
    op.create_table(
        "project_settings",
        sa.Column("project_id", sa.String(32), sa.ForeignKey("projects.id", ondelete="CASCADE"), primary_key=True),
        sa.Column(
            "default_model_route_id", sa.String(32), sa.ForeignKey("model_routes.id", ondelete="SET NULL")
        ),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_table(
        "generation_extractions",
        sa.Column("project_id", sa.String(32), primary_key=True),
        sa.Column("generation_id", sa.String(255), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("reason", sa.Text),
        *[sa.Column(name, sa.Integer, nullable=False, server_default="0")
          for name in ("candidates", "created", "updated", "skipped", "failed")],
        sa.Column("model", sa.String(255)),
        *_timestamps(),
    )
    op.create_table(
        "llm_usage",
        sa.Column("id", sa.BigInteger, sa.Identity(), primary_key=True),
        sa.Column("project_id", sa.String(32), nullable=False),
        sa.Column("ai_provider_id", sa.String(32)),
        sa.Column("model", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("prompt_tokens", sa.Integer, nullable=False),
        sa.Column("completion_tokens", sa.Integer, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_llm_usage_project", "llm_usage", ["project_id", "created_at"])


def downgrade() -> None:
    for table in ("llm_usage", "generation_extractions", "project_settings", "model_routes", "ai_providers"):
        op.drop_table(table)
