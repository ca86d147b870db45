"""Bulk import of entries from JSON Lines, safe to re-run.

Each line is `{"memory_id", "content", "tags"?, "metadata"?, "idempotency_key"?}`. A line without a key gets
one from its own text (and how many identical lines came before it), so importing a line again writes nothing
twice, also after other lines of the file were fixed or added: the service answers a known key with the first
outcome, and such a line counts as skipped (already imported).
Lines of one memory are written in file order, since the dedup decision depends on what came before;
different memories are written concurrently.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

from shared.client._clients import AsyncMemoriesClient
from shared.client.errors import ConnectionFailed, Forbidden, MemoriesError, NotFound, TimedOut, Unauthorized
from shared.ids import keyed_write_id

LINE_FIELDS = frozenset({"memory_id", "content", "tags", "metadata", "idempotency_key"})
MAX_REPORTED_FAILURES = 100
MAIN_OUTCOMES = ("created", "skipped", "failed")  # always reported, even when 0
_BAR_WIDTH = 30
_LINE_WIDTH = 79  # a terminal's 80 columns: a line that fills the last one wraps on some terminals


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
    key_of_its_own: bool = False  # given on the line, not made from its text
    earlier_key: str | None = None  # the key an import before 2026-12-01 gave it: the file's hash and the line number


@dataclass
class ImportSummary:
    """`counts` by outcome: created, skipped (also the already imported), updated, superseded, pending, failed.
    `total` counts the lines to import, not the blank ones (`blank`); a line's number is the file's, blank
    lines included, as its editor shows it."""

    total: int = 0
    blank: int = 0
    counts: Counter[str] = field(default_factory=Counter)
    already_imported: int = 0
    failures: list[tuple[int, str]] = field(default_factory=list)  # the lowest-numbered ones, in line order
    pending: list[tuple[int, str]] = field(default_factory=list)  # (line, write id) of writes not decided in time

    @property
    def done(self) -> int:
        return sum(self.counts.values())

    def fail(self, number: int, reason: str) -> None:
        self.counts["failed"] += 1
        # Memories are written concurrently, so lines fail out of order: the first met are not the first lines.
        bisect.insort(self.failures, (number, reason))
        del self.failures[MAX_REPORTED_FAILURES:]

    @property
    def not_sent(self) -> int:
        """Lines an import stopped before (the service lost, the token refused, an interruption)."""
        return self.total - self.done

    def describe(self) -> str:
        others = "".join(f", {n} {name}" for name, n in self.counts.items() if name not in MAIN_OUTCOMES)
        lines = f"{self.total} line{'' if self.total == 1 else 's'}"
        return (
            (f"{self.done} of {lines}" if self.not_sent else lines)
            + f": {self.counts['created']} created, {self.counts['skipped']} skipped "
            f"({self.already_imported} already imported){others}, {self.counts['failed']} failed"
            + (f", {self.not_sent} not sent" if self.not_sent else "")
            + (f"; {self.blank} blank line{'' if self.blank == 1 else 's'} ignored" if self.blank else "")
        )

    @property
    def listed_failures(self) -> list[tuple[int, str]]:
        """The MAX_REPORTED_FAILURES lowest-numbered failures, by line number."""
        return self.failures

    @property
    def unlisted_failures(self) -> int:
        return self.counts["failed"] - len(self.failures)

    def as_json(self) -> dict[str, Any]:
        counts = {name: self.counts[name] for name in MAIN_OUTCOMES} | dict(self.counts)
        failures = [{"line": number, "error": reason} for number, reason in self.listed_failures]
        return {
            "lines": self.total,
            "blank_lines": self.blank,
            **counts,
            "already_imported": self.already_imported,
            "failures": failures,
            "failures_not_listed": self.unlisted_failures,
            "not_sent": self.not_sent,
            "pending_writes": [{"line": number, "write_id": write_id} for number, write_id in sorted(self.pending)],
        }


def strict_json(text: str) -> Any:
    """`json.loads` without what JSON lacks (NaN, Infinity, which Python reads and the API refuses); a number
    too long or nesting too deep to read is a ValueError too."""
    try:
        return json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def file_digest(data: bytes) -> str:
    """The file's part of the key that imports before 2026-12-01 gave a line (`ImportLine.earlier_key`)."""
    return hashlib.sha256(data).hexdigest()[:16]


# Bytes that were no UTF-8, as a file read with errors="surrogateescape" holds them (lone surrogates, which no
# text decoded from UTF-8 can hold).
_UNDECODED = re.compile("[\udc80-\udcff]")


def parse_lines(text: str, summary: ImportSummary, earlier_digest: str | None = None) -> list[ImportLine]:
    """The importable lines; a malformed one is counted as failed with its reason. Blank lines are counted
    apart and ignored.

    Lines end at "\n" (a "\r" before it is dropped) and nowhere else: U+2028, U+0085 and the like may stand
    unescaped inside a JSON string, and a file's line numbers are what its editor shows. A byte order mark, as
    some editors write, starts the file, not its first line."""
    lines: list[ImportLine] = []
    seen: Counter[str] = Counter()  # identical lines so far, by their key's digest
    text = text.removeprefix("\ufeff")
    # The last line's end starts no line after it; an empty file has none.
    for number, raw in enumerate(text.removesuffix("\n").split("\n") if text else [], start=1):
        raw = raw.removesuffix("\r")
        if not raw.strip():
            summary.blank += 1
            continue
        summary.total += 1
        try:
            line = _parse(number, raw, seen)
        except BadLine as exc:
            summary.fail(number, str(exc))
            continue
        if earlier_digest is not None and not line.key_of_its_own:
            line = replace(line, earlier_key=f"import:{earlier_digest}:{number}")
        lines.append(line)
    return lines


def _parse(number: int, raw: str, seen: Counter[str]) -> ImportLine:
    if _UNDECODED.search(raw):
        raise BadLine("not UTF-8 text")
    if raw.startswith("\ufeff"):  # JSON's own message asks to "decode using utf-8-sig"
        raise BadLine("starts with a byte order mark (U+FEFF), as a file may: another file joined here?")
    try:
        value = strict_json(raw)
    except json.JSONDecodeError as exc:
        raise BadLine(f"not JSON: {exc.msg}") from None
    except ValueError as exc:
        raise BadLine(f"not usable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadLine("not a JSON object")
    if unknown := sorted(set(value) - LINE_FIELDS):
        raise BadLine(f"unknown fields: {', '.join(unknown)}")
    if missing := [name for name in ("memory_id", "content") if name not in value]:
        raise BadLine(f"missing fields: {', '.join(missing)}")
    memory_id, content = value["memory_id"], value["content"]
    for name, given in (("memory_id", memory_id), ("content", content)):
        if not isinstance(given, str):
            raise BadLine(f"{name} must be a string")
    tags, metadata = value.get("tags"), value.get("metadata")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(tag, str) for tag in tags)):
        raise BadLine("tags must be a list of strings")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadLine("metadata must be an object")
    key = value.get("idempotency_key")
    if key is not None and not isinstance(key, str):
        raise BadLine("idempotency_key must be a string")
    if key:  # "" is no key, as an earlier version read it
        return ImportLine(number, memory_id, content, key, tags, metadata, key_of_its_own=True)
    return ImportLine(number, memory_id, content, _line_key(value, seen), tags, metadata)


def _line_key(value: dict[str, Any], seen: Counter[str]) -> str:
    """The line's own key: what it writes, and which of the identical lines of the file it is. A key from the
    file's hash and the line's number changed for every line whenever one was fixed, and a re-run wrote again
    the facts corrected or deleted since."""
    digest = hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:32]
    seen[digest] += 1
    return f"import:{digest}:{seen[digest]}"


async def import_lines(
    client: AsyncMemoriesClient,
    lines: Iterable[ImportLine],
    summary: ImportSummary,
    *,
    concurrency: int = 4,
    on_progress: Callable[[ImportSummary], None] = lambda _summary: None,
) -> ImportSummary:
    """Raises ConnectionFailed, the lines not yet written left untried, when the service cannot be reached, and
    Unauthorized when it refuses the token: no line would get through, and each would fail for the same reason."""
    by_memory: dict[str, list[ImportLine]] = {}
    for line in lines:
        by_memory.setdefault(line.memory_id, []).append(line)
    slots = asyncio.Semaphore(max(concurrency, 1))

    async def write_memory_lines(memory_id: str, batch: list[ImportLine]) -> None:
        project_id: str | None = None  # a key that may only write cannot read its memory: no "already imported"
        try:
            async with slots:
                project_id = (await client.get_memory(memory_id)).project_id
        except Forbidden:
            pass
        except MemoriesError as exc:
            if _unreachable(exc):
                raise
            for line in batch:
                summary.fail(line.number, str(exc))  # its code, message and wrong fields
            on_progress(summary)
            return
        for line in batch:
            async with slots:
                await _write(client, project_id, line, summary)
            on_progress(summary)

    on_progress(summary)
    try:
        async with asyncio.TaskGroup() as writers:  # the first to lose the service stops the others
            for memory_id, batch in by_memory.items():
                writers.create_task(write_memory_lines(memory_id, batch))
    except* (ConnectionFailed, Unauthorized) as lost:
        raise lost.exceptions[0] from None
    return summary


def _unreachable(error: MemoriesError) -> bool:
    """No connection to the service, or no entry with this token: not a line's failure, every line's. A timeout
    is a line's: the service is there, and the line's write may have been applied."""
    return isinstance(error, Unauthorized) or (isinstance(error, ConnectionFailed) and not isinstance(error, TimedOut))


async def _write(
    client: AsyncMemoriesClient, project_id: str | None, line: ImportLine, summary: ImportSummary
) -> None:
    try:
        already = project_id is not None and (
            await _already_written(client, project_id, line.idempotency_key)
            # The same file imported before its lines had keys of their own (2026-12-01): not written again.
            or (line.earlier_key is not None and await _already_written(client, project_id, line.earlier_key))
        )
        if already and not line.key_of_its_own:
            # Its key is its text: nothing to learn by sending it again (and its entry may be gone since: a 409).
            summary.counts["skipped"] += 1
            summary.already_imported += 1
            return
        # A key of the line's own is sent even then: the service answers its first outcome only to the same
        # request, and a 409 when the key was first used for another line (a key given twice, a record whose
        # text changed since).
        written = await client.create_entry(
            line.memory_id,
            line.content,
            tags=line.tags,
            metadata=line.metadata,
            idempotency_key=line.idempotency_key,
        )
    except MemoriesError as exc:
        if _unreachable(exc):
            raise
        if exc.replayed and exc.status == 409 and "write_id" in exc.meta:
            # Imported before, its entry deleted since (a key that may not read learns it only now): not a failure.
            summary.counts["skipped"] += 1
            summary.already_imported += 1
        else:
            summary.fail(line.number, str(exc))  # its code, message and wrong fields
        return
    if already or written.replayed:
        summary.counts["skipped"] += 1
        summary.already_imported += 1
        return
    summary.counts[written.action.value if written.action else written.status] += 1
    if written.status == "pending":
        summary.pending.append((line.number, written.write_id))


async def _already_written(client: AsyncMemoriesClient, project_id: str, idempotency_key: str) -> bool:
    """Whether a write with this key was decided before. The service answers a known key with its first
    outcome (`created` again), so only asking for the write tells a re-run from a first run."""
    try:
        status = await client.get_write(keyed_write_id(project_id, idempotency_key))
    except NotFound:
        return False
    return status.status == "applied"


class ProgressBar:
    """A plain-text bar redrawn in place on stderr ten times a second on a terminal; into a file or pipe, where a
    carriage return redraws nothing (a CI log showed one line of every bar), a line every 10 seconds and the last."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream or sys.stderr
        self._terminal = self._stream.isatty()
        self._interval = 0.1 if self._terminal else 10.0
        self._drawn_at = time.monotonic() if not self._terminal else 0.0  # a short import into a file: one line
        self._drawn = ""

    def update(self, summary: ImportSummary, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._drawn_at < self._interval:
            return
        self._drawn_at = now
        counts = "  ".join(f"{name} {summary.counts[name]}" for name in MAIN_OUTCOMES)
        numbers = f"{summary.done}/{summary.total}  {counts}"
        # Narrower as the counts grow longer (the line only grows, so a redraw leaves nothing of the last one).
        width = max(min(_BAR_WIDTH, _LINE_WIDTH - len(numbers) - len("[] ")), 0)
        filled = width * summary.done // summary.total if summary.total else width
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {numbers}"
        if bar != self._drawn:  # the same bar again (an empty file's 0/0) is not drawn twice
            self._stream.write(f"\r{bar}" if self._terminal else f"{bar}\n")
            self._drawn = bar
        if final and self._terminal:
            self._stream.write("\n")
        self._stream.flush()
