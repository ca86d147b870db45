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
def bench_environment(pids: dict[str, int] | None = None, **env: str) -> Iterator[dict[str, str]]:
    """The environment for the service processes a benchmark starts: servers up, schema migrated. The
    embedded servers' process ids are added to `pids`, for CPU accounting."""
    settings = get_settings()
    root = Path(tempfile.mkdtemp(prefix="memories-bench-"))
    servers: list[EmbeddedPostgres | EmbeddedNats] = []
    try:
        environment = dict(os.environ, **env)
        if not settings.database_url:
            servers.append(EmbeddedPostgres(root / "postgres"))
            environment["DATABASE_URL"] = servers[-1].start()
            _note_pid(pids, "postgres", servers[-1])
        if not settings.nats_url:
            servers.append(EmbeddedNats(root / "nats"))
            environment["NATS_URL"] = servers[-1].start()
            _note_pid(pids, "nats", servers[-1])
        upgrade(environment["DATABASE_URL"])
        yield environment
    finally:
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _note_pid(pids: dict[str, int] | None, name: str, server: EmbeddedPostgres | EmbeddedNats) -> None:
    if pids is not None and server.pid is not None:
        pids[name] = server.pid
