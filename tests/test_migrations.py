"""The Alembic migrations build the tables the models describe: a column added to one and not the other
fails here, not in production."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from shared.db.models import Base
from shared.settings import Settings


def _not_an_index(_object: Any, _name: str | None, type_: str, _reflected: bool, _compare_to: Any) -> bool:
    # Indexes are written in the migrations only (partial, HNSW, trigram: the models do not restate them).
    return type_ != "index"


def test_the_migrated_schema_matches_the_models(settings: Settings) -> None:
    assert settings.database_url
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"include_object": _not_an_index})
            differences = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    assert differences == []
