"""Apply the Alembic migrations: `memories migrate`, and `memories up` before it starts the services. Each service
waits at start for the schema its version needs (`wait_for_schema`)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from psycopg.errors import UndefinedTable
from sqlalchemy import text
from sqlalchemy.exc import OperationalError, ProgrammingError
from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger("memories.migrate")

_MIGRATIONS = Path(__file__).parent / "migrations"
SCHEMA_POLL_S = 5.0


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(_MIGRATIONS))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str) -> None:
    command.downgrade(alembic_config(database_url), revision)


async def wait_for_schema(engine: AsyncEngine, *, poll_s: float = SCHEMA_POLL_S) -> None:
    """Until the database's schema is the one this version's code reads and writes, or a later one.

    Deployed beside the migration that it needs (an upgrade's init Job runs `memories migrate` while the new pods
    start), a service answered 500 on the columns and tables not made yet, and failed writes for it. A later schema
    (this is an old pod of a rolling upgrade) is fine: a migration keeps the previous version working. A database that
    cannot be reached is waited for too (a failover during the upgrade): started on the old schema meanwhile, the
    service would fail as above."""
    script = ScriptDirectory.from_config(alembic_config(""))
    needed = script.get_current_head()
    known = {revision.revision for revision in script.walk_revisions()}
    waited = False
    while True:
        try:
            async with engine.connect() as connection:
                current = await connection.scalar(text("SELECT version_num FROM alembic_version"))
        except ProgrammingError as exc:
            if not isinstance(exc.orig, UndefinedTable):  # a privilege missing, say: no migration will cure it
                raise
            current = None  # nothing migrated yet
        except (OperationalError, OSError) as exc:
            log.warning("the database's schema cannot be checked yet: %s", str(exc).splitlines()[0])
            waited = True
            await asyncio.sleep(poll_s)
            continue
        if current == needed or (current is not None and current not in known):
            if waited:
                log.info("the database's schema is at %s: starting", current)
            return
        log.warning(
            "the database's schema is at %s, this version needs %s: waiting for `memories migrate`",
            current or "no revision", needed,
        )
        waited = True
        await asyncio.sleep(poll_s)
