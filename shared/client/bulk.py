"""Bulk import of entries from JSON Lines, safe to re-run.

Each line is `{"memory_id", "content", "tags"?, "metadata"?, "idempotency_key"?}`. A line without a key gets
one from the file's hash and its line number, so importing the same file again writes nothing twice: the
service answers a known key with the first outcome, and such a line counts as skipped (already imported).
Lines of one memory are written in file order, since the dedup decision depends on what came before;
different memories are written concurrently.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from shared.client._clients import AsyncMemoriesClient
from shared.client.errors import MemoriesError, NotFound
from shared.ids import keyed_write_id

LINE_FIELDS = frozenset({"memory_id", "content", "tags", "metadata", "idempotency_key"})
MAX_REPORTED_FAILURES = 100
MAIN_OUTCOMES = ("created", "skipped", "failed")  # always reported, even when 0
_BAR_WIDTH = 30


class BadLine(Exception):
    """A line that cannot be imported; its message says why."""


@dataclass(frozen=True)
class ImportLine:
    number: int
    memory_id: str
    content: str
    idempotency_key: str
    tags: list[str] | None = None
    metadata: dict[str, Any] | None = None


@dataclass
class ImportSummary:
    """`counts` by outcome: created, skipped (also the already imported), updated, superseded, pending, failed."""

    total: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    already_imported: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    def fail(self, number: int, reason: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < MAX_REPORTED_FAILURES:
            self.failures.append((number, reason))

    def describe(self) -> str:
        others = "".join(f", {n} {name}" for name, n in self.counts.items() if name not in MAIN_OUTCOMES)
        return (
            f"{self.total} lines: {self.counts['created']} created, {self.counts['skipped']} skipped "
            f"({self.already_imported} already imported){others}, {self.counts['failed']} failed"
        )

    def as_json(self) -> dict[str, Any]:
        counts = {name: self.counts[name] for name in MAIN_OUTCOMES} | dict(self.counts)
        failures = [{"line": number, "error": reason} for number, reason in self.failures]
        return {
            "lines": self.total,
            **counts,
            "already_imported": self.already_imported,
            "failures": failures,
        }


def file_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def parse_lines(text: str, digest: str, summary: ImportSummary) -> list[ImportLine]:
    """The importable lines; a malformed one is counted as failed with its reason. Blank lines are ignored.

    Lines end at "\n" (a "\r" before it is dropped) and nowhere else: U+2028, U+0085 and the like may stand
    unescaped inside a JSON string, and a file's line numbers are what its editor shows."""
    lines: list[ImportLine] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            continue
        summary.total += 1
        try:
            lines.append(_parse(number, raw, digest))
        except BadLine as exc:
            summary.fail(number, str(exc))
    return lines


def _parse(number: int, raw: str, digest: str) -> ImportLine:
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not JSON: {exc.msg}") from None
    if not isinstance(value, dict):
        raise BadLine("not a JSON object")
    if unknown := sorted(set(value) - LINE_FIELDS):
        raise BadLine(f"unknown fields: {', '.join(unknown)}")
    memory_id, content = value.get("memory_id"), value.get("content")
    if not isinstance(memory_id, str) or not isinstance(content, str):
        raise BadLine("memory_id and content must be strings")
    tags, metadata = value.get("tags"), value.get("metadata")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(tag, str) for tag in tags)):
        raise BadLine("tags must be a list of strings")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadLine("metadata must be an object")
    key = value.get("idempotency_key")
    if key is not None and not isinstance(key, str):
        raise BadLine("idempotency_key must be a string")
    return ImportLine(number, memory_id, content, key or f"import:{digest}:{number}", tags, metadata)


async def import_lines(
    client: AsyncMemoriesClient,
    lines: Iterable[ImportLine],
    summary: ImportSummary,
    *,
    concurrency: int = 4,
    on_progress: Callable[[ImportSummary], None] = lambda _summary: None,
) -> ImportSummary:
    by_memory: dict[str, list[ImportLine]] = {}
    for line in lines:
        by_memory.setdefault(line.memory_id, []).append(line)
    slots = asyncio.Semaphore(max(concurrency, 1))

    async def write_memory_lines(memory_id: str, batch: list[ImportLine]) -> None:
        try:
            async with slots:
                project_id = (await client.get_memory(memory_id)).project_id
        except MemoriesError as exc:
            for line in batch:
                summary.fail(line.number, _reason(exc))
            on_progress(summary)
            return
        for line in batch:
            async with slots:
                await _write(client, project_id, line, summary)
            on_progress(summary)

    on_progress(summary)
    await asyncio.gather(*(write_memory_lines(memory_id, batch) for memory_id, batch in by_memory.items()))
    return summary


async def _write(
    client: AsyncMemoriesClient, project_id: str, line: ImportLine, summary: ImportSummary
) -> None:
    try:
        already = await _already_written(client, project_id, line.idempotency_key)
        # Sent even then: the service answers its first outcome only to the same request, and a 409 when the
        # key was first used for another line (a record whose text changed since, a key given twice).
        written = await client.create_entry(
            line.memory_id,
            line.content,
            tags=line.tags,
            metadata=line.metadata,
            idempotency_key=line.idempotency_key,
        )
    except MemoriesError as exc:
        summary.fail(line.number, _reason(exc))
        return
    if already:
        summary.counts["skipped"] += 1
        summary.already_imported += 1
        return
    summary.counts[written.action.value if written.action else written.status] += 1


def _reason(error: MemoriesError) -> str:
    """The envelope's code and message, and the fields it names: in a large file, what to fix on the line."""
    named = [
        f"{problem.get('field')}: {problem.get('message')}" if isinstance(problem, dict) else str(problem)
        for problem in error.meta.get("invalid_fields") or []
    ]
    for kind in ("missing_fields", "unknown_fields"):
        if fields := error.meta.get(kind):
            named.append(f"{kind.replace('_', ' ')}: {', '.join(map(str, fields))}")
    return f"{error.code}: {error.message}" + (f" ({'; '.join(named)})" if named else "")


async def _already_written(client: AsyncMemoriesClient, project_id: str, idempotency_key: str) -> bool:
    """Whether a write with this key was decided before. The service answers a known key with its first
    outcome (`created` again), so only asking for the write tells a re-run from a first run."""
    try:
        status = await client.get_write(keyed_write_id(project_id, idempotency_key))
    except NotFound:
        return False
    return status.status == "applied"


class ProgressBar:
    """A plain-text bar redrawn in place on stderr: ten times a second on a terminal, once a second into a
    file or pipe (a log should not hold a line per entry)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._interval = 0.1 if self._stream.isatty() else 1.0
        self._drawn_at = 0.0

    def update(self, summary: ImportSummary, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._drawn_at < self._interval:
            return
        self._drawn_at = now
        filled = _BAR_WIDTH * summary.done // summary.total if summary.total else _BAR_WIDTH
        counts = "  ".join(f"{name} {summary.counts[name]}" for name in MAIN_OUTCOMES)
        bar = f"[{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {summary.done}/{summary.total}  {counts}"
        self._stream.write(f"\r{bar}" + ("\n" if final else ""))
        self._stream.flush()
