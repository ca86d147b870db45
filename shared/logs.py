"""Structured logs: one JSON object per line, carrying the ids of the unit of work in hand.

A record's fields are its `extra=` keys plus those of the enclosing `log_context(...)`: the writer opens
one per message with the write id and the memory id, so every line logged while that write is handled —
by the handler, the model steps, the dead-letter publisher — names them without passing them around.
An explicit `extra=` key wins over the context's value of the same name.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, TextIO

__all__ = ["ContextFilter", "JsonFormatter", "TextFormatter", "configure", "log_context", "resolve_format"]

_NO_FIELDS: Mapping[str, Any] = MappingProxyType({})
_context: ContextVar[Mapping[str, Any]] = ContextVar("memories_log_context", default=_NO_FIELDS)

# Attributes every LogRecord has; anything else on a record came from `extra=` or the context.
_RECORD_ATTRIBUTES = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {
    "message",
    "asctime",
    "taskName",  # Python 3.12+
    "litellm_redacted",  # litellm's secret-redaction filter marks the records it scrubbed: not a field of ours
    "color_message",  # uvicorn's copy of the message with terminal colour codes: the message again
}


@contextmanager
def log_context(**fields: Any) -> Iterator[None]:
    """Add `fields` to every record logged inside the block, in this task and the tasks it starts."""
    token = _context.set({**_context.get(), **fields})
    try:
        yield
    finally:
        _context.reset(token)


class ContextFilter(logging.Filter):
    """Stamps the context's fields on each record. Installed on the handler, so records that propagate up
    from any logger get them too (a logger's own filters only see records logged on that very logger)."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in _context.get().items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in record.__dict__.items() if key not in _RECORD_ATTRIBUTES}


class JsonFormatter(logging.Formatter):
    """`{"time", "level", "logger", "message", <extra fields>…, "exception"?}` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in extra_fields(record).items():
            line.setdefault(key, value)  # an extra named like a base field cannot overwrite it
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        # default=str: ids are strings already; a datetime or a UUID in `extra` must not lose the line.
        return json.dumps(line, default=str, ensure_ascii=False)


# Control characters (line breaks, terminal escapes, NUL) and Unicode's line separators, written escaped.
_ESCAPED = str.maketrans(
    {code: repr(chr(code))[1:-1] for code in [*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029]}
)


class TextFormatter(logging.Formatter):
    """For a terminal: the classic line, then the structured fields as key=value. A message or a field quoting
    what a client sent (an id, a model's name) cannot break the line or forge one: its control characters are
    escaped. A traceback, the formatter's own, keeps its lines."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def formatMessage(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{key}={value}" for key, value in extra_fields(record).items())
        base = super().formatMessage(record)
        return (f"{base} [{fields}]" if fields else base).translate(_ESCAPED)


def resolve_format(setting: str, stream: TextIO) -> str:
    """`auto` is text on a terminal (someone reading) and JSON otherwise (a collector reading)."""
    if setting in ("json", "text"):
        return setting
    isatty = getattr(stream, "isatty", None)
    return "text" if isatty is not None and isatty() else "json"


class _CurrentStderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to `sys.stderr` as it is when a line is logged, as logging's own last-resort handler does. Bound to the
    stream of the moment it was made, a command run in-process (tests call `main([...])`) left the root logger writing
    to that test's captured stream, closed by the next test."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, _stream: TextIO) -> None:
        pass


def configure(log_format: str = "auto", level: int = logging.INFO, stream: TextIO | None = None) -> str:
    """Replace the root logger's handlers with one that writes `log_format` to `stream` (stderr).

    Returns the format chosen.
    """
    chosen = resolve_format(log_format, stream if stream is not None else sys.stderr)
    handler = logging.StreamHandler(stream) if stream is not None else _CurrentStderrHandler()
    handler.setFormatter(JsonFormatter() if chosen == "json" else TextFormatter())
    handler.addFilter(ContextFilter())
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    # Alembic narrates its own start-up (a "setup plugin" line per plugin) at INFO on every command, and
    # httpx each request the client SDK makes (the CLI, the benchmarks): noise at INFO.
    for chatty in ("alembic.runtime.plugins", "httpx"):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
    return chosen
