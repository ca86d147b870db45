"""Structured logs: the JSON line format, the per-write context, and the writer's lines carrying the ids."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import pytest
from nats.aio.client import Client as NatsClient

from shared import bus, bus_connection
from shared.logs import ContextFilter, JsonFormatter, TextFormatter, configure, log_context, resolve_format
from shared.settings import Settings


def record(message: str = "write decided", *args: Any, exc_info: Any = None, **extra: Any) -> logging.LogRecord:
    made = logging.LogRecord("memories.writer", logging.INFO, __file__, 1, message, args, exc_info)
    for key, value in extra.items():
        setattr(made, key, value)
    return made


def test_a_record_with_extra_fields_is_one_json_line_with_them() -> None:
    moment = datetime(2024, 5, 1, tzinfo=UTC)
    line = JsonFormatter().format(
        record("decided %s", "wr_1", write_id="wr_1", memory_id="mem_1", score=0.93, at=moment, tags=["a"])
    )
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed.pop("time").endswith("+00:00")
    assert parsed == {
        "level": "INFO",
        "logger": "memories.writer",
        "message": "decided wr_1",
        "write_id": "wr_1",
        "memory_id": "mem_1",
        "score": 0.93,
        "at": str(moment),  # not JSON by itself: written as text rather than losing the line
        "tags": ["a"],
    }


def test_litellms_mark_on_a_record_it_scrubbed_is_not_a_field() -> None:
    # litellm's secret-redaction filter stamps the records it passes with a private marker object.
    parsed = json.loads(JsonFormatter().format(record("Shutting down", litellm_redacted=object(), write_id="wr_1")))
    assert "litellm_redacted" not in parsed and parsed["write_id"] == "wr_1"


def test_uvicorns_coloured_copy_of_a_message_is_not_a_field() -> None:
    # Printed as a field, its colour codes came out escaped on every uvicorn line of the text log.
    coloured = record("Finished server process [%d]", 7, color_message="Finished server process [\x1b[36m%d\x1b[0m]")
    assert TextFormatter().format(coloured).endswith("Finished server process [7]")
    assert "color_message" not in json.loads(JsonFormatter().format(coloured))


def test_an_exception_stays_on_the_same_line_and_extras_cannot_replace_base_fields() -> None:
    try:
        raise ValueError("broken\nacross lines")
    except ValueError:
        failing = record("write failed", exc_info=sys.exc_info(), level="spoofed", write_id="wr_2")
    line = JsonFormatter().format(failing)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["level"] == "INFO" and parsed["write_id"] == "wr_2"
    assert "ValueError: broken\nacross lines" in parsed["exception"]


def test_the_context_stamps_its_fields_and_an_explicit_extra_wins() -> None:
    stamp = ContextFilter()
    with log_context(write_id="wr_1", memory_id="mem_1"):
        with log_context(action="created"):
            inner = record()
            stamp.filter(inner)
        explicit = record(memory_id="mem_explicit")
        stamp.filter(explicit)
    outside = record()
    stamp.filter(outside)
    assert (inner.write_id, inner.memory_id, inner.action) == ("wr_1", "mem_1", "created")  # type: ignore[attr-defined]
    assert explicit.memory_id == "mem_explicit" and not hasattr(explicit, "action")  # type: ignore[attr-defined]
    assert not hasattr(outside, "write_id")


async def test_the_context_follows_tasks_started_inside_it_and_not_sibling_tasks() -> None:
    async def write_id_seen() -> Any:
        seen = record()
        ContextFilter().filter(seen)
        return getattr(seen, "write_id", None)

    with log_context(write_id="wr_inside"):
        inside = asyncio.create_task(write_id_seen())
    outside = asyncio.create_task(write_id_seen())
    assert await inside == "wr_inside"
    assert await outside is None


def test_text_lines_keep_the_fields_as_key_value() -> None:
    line = TextFormatter().format(record(write_id="wr_1", memory_id="mem_1"))
    assert line.endswith("INFO memories.writer write decided [write_id=wr_1 memory_id=mem_1]")
    assert TextFormatter().format(record()).endswith("memories.writer write decided")


def test_a_text_line_cannot_be_broken_or_forged_by_what_a_client_sent() -> None:
    forged = "r\n2026-12-01 21:40:00,000 ERROR memories.api FORGED\x1b[2J\x00"
    line = TextFormatter().format(record("model route %s does not exist", forged, model=f"m\r{forged}"))
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\x00" not in line
    assert "route r\\n2026-12-01 21:40:00,000 ERROR memories.api FORGED\\x1b[2J\\x00 does not exist" in line
    try:
        raise ValueError("boom")
    except ValueError:
        failed = TextFormatter().format(record("write failed", exc_info=sys.exc_info()))
    assert failed.count("\n") >= 2 and "Traceback (most recent call last):\n" in failed  # the traceback keeps its lines


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_is_text_on_a_terminal_and_json_otherwise() -> None:
    assert resolve_format("auto", Terminal()) == "text"
    assert resolve_format("auto", io.StringIO()) == "json"
    assert resolve_format("json", Terminal()) == "json"
    assert resolve_format("text", io.StringIO()) == "text"
    with pytest.raises(ValueError):
        Settings(memories_log_format="yaml")


@pytest.fixture
def root_logger() -> Iterator[logging.Logger]:
    """The root logger, restored afterwards (pytest's own capture lives on it)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_configure_replaces_the_root_handlers_with_one_json_writer(root_logger: logging.Logger) -> None:
    out = io.StringIO()
    assert configure("auto", stream=out) == "json"
    assert len(root_logger.handlers) == 1
    with log_context(write_id="wr_9"):
        logging.getLogger("memories.test").info("hello %s", "there", extra={"memory_id": "mem_9"})
    logging.getLogger("memories.test").debug("not at INFO")
    logging.getLogger("httpx").info("HTTP Request: POST http://api/ \"HTTP/1.1 201 Created\"")  # the SDK's requests
    [line] = out.getvalue().splitlines()
    parsed = json.loads(line)
    assert (parsed["message"], parsed["write_id"], parsed["memory_id"]) == ("hello there", "wr_9", "mem_9")


@pytest.fixture
def json_lines(root_logger: logging.Logger) -> Iterator[io.StringIO]:
    """Everything logged at INFO and above while the test runs, as the services write it."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(ContextFilter())
    root_logger.addHandler(handler)
    root_logger.setLevel(logging.INFO)
    yield out


def parsed_lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_command_that_loads_the_migrations_logs_nothing_before_its_work() -> None:
    """`memories bench write --help` imports alembic; its start-up lines are noise on every command."""
    command = [sys.executable, "-m", "services.cli", "bench", "write", "--help"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--writers" in done.stdout
    assert "setup plugin" not in done.stderr, done.stderr


async def test_every_writer_line_of_a_write_names_the_write_and_the_memory(
    client: httpx.AsyncClient, memory: dict[str, Any], json_lines: io.StringIO
) -> None:
    posted = await client.post("/memory-entries", json={"memory_id": memory["id"], "content": "Logs are JSON"})
    assert posted.status_code == 201, posted.text
    written = posted.json()
    lines = [line for line in parsed_lines(json_lines) if line.get("write_id") == written["write_id"]]
    [decided] = [line for line in lines if line["message"] == "write decided"]
    assert decided["logger"] == "memories.writer"
    assert (decided["memory_id"], decided["action"], decided["entry_id"]) == (memory["id"], "created", written["id"])
    assert decided["replayed"] is False
    assert all(line["memory_id"] == memory["id"] for line in lines)


async def test_a_dead_letter_line_names_what_it_can_of_an_undecodable_write(
    settings: Settings, writers: list[Any], json_lines: io.StringIO
) -> None:
    assert settings.nats_url
    nc: NatsClient = await bus_connection.connect(settings.nats_url, name="test-logs")
    try:
        subject = bus.write_subject("mem_unreadable", settings.memories_partitions)
        await nc.jetstream().publish(subject, b'{"event_id": "wr_unreadable"}', stream=bus.WRITES_STREAM)
        async with asyncio.timeout(15):
            while not any(line.get("memory_id") == "mem_unreadable" for line in parsed_lines(json_lines)):
                await asyncio.sleep(0.02)
    finally:
        await nc.close()
    [line] = [line for line in parsed_lines(json_lines) if line.get("memory_id") == "mem_unreadable"]
    assert line["level"] == "ERROR" and line["message"].startswith("dead-lettering message from")
    assert (line["write_id"], line["origin"]) == ("wr_unreadable", "writer")


async def test_a_model_steps_line_names_the_write_and_the_memory(
    client: httpx.AsyncClient, memory: dict[str, Any], json_lines: io.StringIO
) -> None:
    from shared.scripted_llm import scripted_llm

    model = scripted_llm().script("merge-down-logged", RuntimeError("provider down"))

    async def tool_write(content: str) -> None:
        agent = {"id": "agent_1", "model": model, "knowledge_config": {"write_memory_id": memory["id"]}}
        body = {"content": content, "agent": agent, "project_id": memory["project_id"]}
        response = await client.post("/tools/write_memory", json=body)
        assert response.status_code == 200 and response.json()["action"] == "created", response.text

    await tool_write("Customer prefers email over phone calls")
    await tool_write("Customer prefers email over phone calls, ideally in the morning")  # similar: a merge is asked
    [failed] = [line for line in parsed_lines(json_lines) if line.get("logger") == "memories.llm"]
    assert "merge completion" in failed["message"]
    assert failed["memory_id"] == memory["id"] and str(failed.get("write_id", "")).startswith("wr_")


def test_the_log_goes_to_standard_error_as_it_is_when_a_line_is_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    # Bound to the stream of the moment `configure` ran, the root logger of a test that ran `main([...])` wrote into
    # that test's captured stderr after it was closed: "--- Logging error ---" tracebacks in a later test's output.
    root = logging.getLogger()
    kept = root.handlers[:]
    try:
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        configure("text")
        now = io.StringIO()
        monkeypatch.setattr(sys, "stderr", now)
        logging.getLogger("memories.test").warning("after stderr changed")
        assert "after stderr changed" in now.getvalue()
    finally:
        root.handlers[:] = kept
