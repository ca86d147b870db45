"""The Alembic migrations build the tables the models describe: a column added to one and not the other
fails here, not in production."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory

from shared.db.migrate import alembic_config, downgrade, upgrade, wait_for_schema
from shared.db.models import Base
from shared.db.session import create_engine
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


def test_references_to_an_entry_are_followed_through_an_index(settings: Settings) -> None:
    # The statements that follow a reference back: the foreign key's, when an entry is deleted, and an entry's
    # history. Seq scans are priced out, so a plan without an index scan means no index can serve them.
    statements = {
        "ix_entries_superseded_by": "UPDATE memory_entries SET superseded_by_entry_id = NULL"
        " WHERE superseded_by_entry_id = 'mem_entry_aaaaaaaaaaaaaaaa'",
        "ix_history_related_entry": "SELECT id FROM entry_history"
        " WHERE entry_id = 'mem_entry_aaaaaaaaaaaaaaaa' OR related_entry_id = 'mem_entry_aaaaaaaaaaaaaaaa'",
    }
    assert settings.database_url
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            connection.execute(sa.text("SET LOCAL enable_seqscan = off"))
            for index, statement in statements.items():
                plan = "\n".join(connection.scalars(sa.text("EXPLAIN " + statement)))
                assert index in plan, plan
    finally:
        engine.dispose()


async def test_an_upgrade_clears_the_texts_that_deleted_entries_left_in_their_history(
    settings: Settings, client: httpx.AsyncClient, memory: dict[str, Any]
) -> None:
    # Deleted before the services cleared them (migration 0010): the texts of entries that are gone.
    assert settings.database_url
    live = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Still here"})
    rows = {"gone": "mem_entry_GoneGoneGoneGone", "live": live.json()["id"]}
    engine = sa.create_engine(settings.database_url)
    try:
        with engine.begin() as connection:
            for entry_id in rows.values():
                connection.execute(
                    sa.text(
                        "INSERT INTO entry_history (project_id, memory_id, entry_id, action, content_before, content_after)"
                        " VALUES ('proj_x', 'mem_x', :id, 'edited', 'old text', 'new text')"
                    ),
                    {"id": entry_id},
                )
        downgrade(settings.database_url, "0009")
        upgrade(settings.database_url)
        with engine.begin() as connection:
            texts = {
                name: connection.execute(
                    sa.text("SELECT content_before, content_after FROM entry_history WHERE entry_id = :id"
                            " AND memory_id = 'mem_x'"),
                    {"id": entry_id},
                ).one()
                for name, entry_id in rows.items()
            }
            connection.execute(sa.text("DELETE FROM entry_history WHERE memory_id = 'mem_x'"))
    finally:
        engine.dispose()
    assert texts == {"gone": (None, None), "live": ("old text", "new text")}


async def test_a_service_waits_for_the_schema_its_version_needs_and_not_for_a_later_one(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # Started beside the upgrade's migration (the init Job), new pods answered 500 on columns not made yet and failed
    # writes for it. An old pod of a rolling upgrade, against the newer schema, goes on.
    assert settings.database_url
    engine = create_engine(settings.database_url, pool_size=1, max_overflow=0)
    needed = ScriptDirectory.from_config(alembic_config("")).get_current_head()

    async def set_revision(revision: str) -> None:
        async with engine.begin() as connection:
            await connection.execute(sa.text("UPDATE alembic_version SET version_num = :r"), {"r": revision})

    previous = f"{int(needed) - 1:04d}"
    try:
        await set_revision(previous)
        waiting = asyncio.create_task(wait_for_schema(engine, poll_s=0.05))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        assert f"the database's schema is at {previous}, this version needs {needed}" in caplog.text
        await set_revision(needed)  # `memories migrate` done
        await asyncio.wait_for(waiting, 5)
        await set_revision("9999")  # made by a later version
        await asyncio.wait_for(wait_for_schema(engine, poll_s=0.05), 1)
        await set_revision(needed)
        # Nothing migrated yet (no alembic_version): waited for, until `memories migrate` has made it.
        async with engine.begin() as connection:
            await connection.execute(sa.text("ALTER TABLE alembic_version RENAME TO alembic_version_aside"))
        waiting = asyncio.create_task(wait_for_schema(engine, poll_s=0.05))
        await asyncio.sleep(0.5)
        assert not waiting.done()
        async with engine.begin() as connection:
            await connection.execute(sa.text("ALTER TABLE alembic_version_aside RENAME TO alembic_version"))
        await asyncio.wait_for(waiting, 5)
    finally:
        async with engine.begin() as connection:
            await connection.execute(sa.text("ALTER TABLE IF EXISTS alembic_version_aside RENAME TO alembic_version"))
        await set_revision(needed)
        await engine.dispose()


async def test_a_service_waits_for_a_database_it_cannot_reach_yet_before_it_trusts_its_schema(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    # It went on unchecked: a failover during an upgrade let a new pod start on the old schema.
    unreachable = create_engine("postgresql+psycopg://memories@127.0.0.1:9/memories", pool_size=1, max_overflow=0)
    waiting = asyncio.create_task(wait_for_schema(unreachable, poll_s=0.05))
    try:
        await asyncio.sleep(0.5)
        assert not waiting.done()
        assert "the database's schema cannot be checked yet" in caplog.text
    finally:
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        await unreachable.dispose()
