"""The servers a benchmark runs against: DATABASE_URL / NATS_URL when set, else embedded ones in a temp dir."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from shared.db.migrate import upgrade
from shared.servers import EmbeddedNats, EmbeddedPostgres
from shared.settings import get_settings


@contextmanager
def bench_environment(**env: str) -> Iterator[dict[str, str]]:
    """The environment for the service processes a benchmark starts: servers up, schema migrated."""
    settings = get_settings()
    root = Path(tempfile.mkdtemp(prefix="memories-bench-"))
    servers: list[EmbeddedPostgres | EmbeddedNats] = []
    try:
        environment = dict(os.environ, **env)
        if not settings.database_url:
            servers.append(EmbeddedPostgres(root / "postgres"))
            environment["DATABASE_URL"] = servers[-1].start()
        if not settings.nats_url:
            servers.append(EmbeddedNats(root / "nats"))
            environment["NATS_URL"] = servers[-1].start()
        upgrade(environment["DATABASE_URL"])
        yield environment
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
