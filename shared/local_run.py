"""What a running `memories up` notes in its data directory for the one-shot commands of other shells: where its
API and its NATS listen. Light on purpose: the CLI's verbs read it on every call (shared.servers, which starts the
servers, imports psycopg and psutil)."""

from __future__ import annotations

from pathlib import Path

LOCAL_RUN_NATS_FILE = "nats_url"
"""In a data directory: the NATS URL of the `memories up` running on it (written at its start, removed at its stop)."""

NATS_URL_MISSING = "NATS_URL is not set, and no `memories up` is running on this data directory (MEMORIES_DATA_DIR)"


LOCAL_RUN_API_FILE = "api_url"
"""Where a running `memories up` notes its API's address (its --port, its --host), for the CLI's verbs."""


def _noted(data_dir: Path, name: str) -> str | None:
    """What a `memories up` running on this data directory noted there; None when nothing is (or it just went)."""
    try:
        return (data_dir / name).read_text().strip() or None
    except OSError:
        return None


def local_api_url(data_dir: Path) -> str | None:
    """The API of a `memories up` running on this data directory, as it noted it."""
    return _noted(data_dir, LOCAL_RUN_API_FILE)


def nats_url_for(configured: str | None, data_dir: Path) -> str | None:
    """NATS_URL, else the bus of a `memories up` running on this data directory: one-shot commands (`bus init`,
    `dlq`) find the local run's embedded server, whose port is chosen at each start."""
    return configured or _noted(data_dir, LOCAL_RUN_NATS_FILE)
