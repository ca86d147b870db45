"""The resource verbs of the `memories` CLI, run in-process against the API served by uvicorn (real
PostgreSQL, NATS and writers): --json output, tables, exit codes, and a re-runnable JSONL import."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services import cli_resources
from services.cli import main
from services.cli_resources import display_width, print_table
from shared import repository as repo
from shared.client import AsyncMemoriesClient
from shared.client.bulk import ImportSummary, ProgressBar, file_digest, parse_lines
from shared.servers import LOOPBACK, free_port
from shared.settings import Settings, get_settings
from tests.conftest import ADMIN_TOKEN
from tests.test_client import serve_api


@pytest.fixture(scope="module")
def api_url(settings: Settings, writers: list[Any]) -> Iterator[str]:
    with serve_api(settings) as url:
        yield url


class Cli:
    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url = url
        self.capsys = capsys

    async def raw(self, *argv: str) -> tuple[int, str, str]:
        """Exit code, stdout, stderr. On a thread: the writers run on the test's loop, which must keep going."""
        root = logging.getLogger()
        handlers, level = list(root.handlers), root.level
        try:
            code = await asyncio.to_thread(main, list(argv))
        except SystemExit as exit_:  # argparse's usage errors
            code = int(exit_.code or 0)
        finally:
            # main() points the root logger at this test's captured stderr; later tests must not write there.
            root.handlers[:] = handlers
            root.setLevel(level)
        out, err = self.capsys.readouterr()
        assert "Traceback" not in err
        return code, out, err

    async def __call__(self, *argv: str) -> tuple[int, str, str]:
        return await self.raw(*argv, "--url", self.url, "--token", ADMIN_TOKEN)

    async def json(self, *argv: str) -> Any:
        code, out, err = await self(*argv, "--json")
        assert code == 0, err
        return json.loads(out)


@pytest.fixture
def cli(api_url: str, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(api_url, capsys)


@pytest.fixture
async def project_id(cli: Cli) -> str:
    return str((await cli.json("create-project", "--name", "cli tests"))["id"])


@pytest.fixture
async def memory_id(cli: Cli, project_id: str) -> str:
    memory = await cli.json(
        "create-memory",
        "--project-id",
        project_id,
        "--name",
        "Customer Preferences",
        "--tags",
        '["customer", "crm"]',
    )
    return str(memory["id"])


async def test_memory_verbs(cli: Cli, project_id: str) -> None:
    created = await cli.json(
        "create-memory",
        "--project-id",
        project_id,
        "--name",
        "Customer Preferences",
        "--tags",
        '["customer", "crm"]',
        "--description",
        "what customers like",
    )
    assert (created["name"], created["tags"], created["description"]) == (
        "Customer Preferences",
        ["customer", "crm"],
        "what customers like",
    )
    await cli.json("create-memory", "--project-id", project_id, "--name", "Billing", "--tags", '["finance"]')
    listed = await cli.json("list-memories", "--project-id", project_id, "--tags", "cust*", "nothing?")
    assert [m["id"] for m in listed["data"]] == [created["id"]] and listed["total"] == 1
    code, table, _ = await cli("list-memories", "--project-id", project_id)
    assert code == 0 and table.splitlines()[0].split() == ["ID", "NAME", "TAGS", "PROJECT"]
    assert "Billing" in table and "(2 of 2, offset 0)" in table
    assert await cli.json("get-memory", created["id"]) == created

    updated = await cli.json("update-memory", created["id"], "--name", "Preferences", "--tags", "null")
    assert (updated["name"], updated["tags"], updated["description"]) == (
        "Preferences",
        None,
        "what customers like",
    )
    cleared = await cli.json("update-memory", created["id"], "--description", "null")
    assert cleared["description"] is None and cleared["name"] == "Preferences"
    guarded = await cli.json("create-memory", "--project-id", project_id, "--name", "G", "--write-policy", "guarded")
    assert guarded["write_policy"] == "guarded"
    assert (await cli.json("update-memory", guarded["id"], "--write-policy", "seed"))["write_policy"] == "seed"
    code, out, _ = await cli("delete-memory", created["id"])
    assert code == 0 and out.strip() == f"deleted {created['id']}"
    code, _, err = await cli("delete-memory", "")  # "/memories/" would be the list: not a deletion
    assert code == 2 and "an id must not be empty" in err
    code, out, err = await cli("get-memory", created["id"])
    assert (code, out) == (1, "") and err.startswith("error: RESOURCE_NOT_FOUND: memory")


async def test_entry_verbs(cli: Cli, memory_id: str) -> None:
    content = "Reject refunds above $500 for the traffic-manager role"
    first = await cli.json(
        "create-memory-entry",
        "--memory-id",
        memory_id,
        "--content",
        content,
        "--tags",
        '["role:traffic-manager"]',
        "--metadata",
        '{"evidence": "high"}',
    )
    assert (first["action"], first["status"]) == ("created", "applied")
    entry = first["entry"]
    assert entry["tags"] == ["role:traffic-manager"] and entry["metadata"] == {"evidence": "high"}
    code, out, _ = await cli("create-memory-entry", "--memory-id", memory_id, "--content", content.lower())
    assert code == 0 and out.startswith(f"skipped: {entry['id']}") and "replay" not in out
    keyed = [
        "create-memory-entry",
        "--memory-id",
        memory_id,
        "--content",
        "Ships to Porto",
        "--idempotency-key",
        "cli-key-1",
    ]
    assert (await cli.json(*keyed))["write_id"] == (await cli.json(*keyed))["write_id"]
    code, out, _ = await cli(*keyed)  # the table says so too, not only --json's "replayed"
    assert code == 0 and out.startswith("created: ") and "a replay of an earlier write" in out

    code, _, err = await cli(
        "create-memory-entry", "--memory-id", memory_id, "--content", "x", "--duplicate-threshold", "1.5"
    )
    assert code == 1 and "VALIDATION_FAILED" in err and "duplicate_threshold" in err

    listed = await cli.json("list-memory-entries", "--memory-id", memory_id)
    assert [e["content"] for e in listed["data"]] == [content, "Ships to Porto"]
    code, table, _ = await cli("list-memory-entries", "--memory-id", memory_id, "--include-invalidated")
    assert code == 0 and "CONTENT" in table.splitlines()[0] and "Ships to Porto" in table
    edited = await cli.json(
        "update-memory-entry", entry["id"], "--content", "No refunds above $500", "--metadata", "null"
    )
    assert (edited["content"], edited["metadata"], edited["tags"]) == (
        "No refunds above $500",
        None,
        ["role:traffic-manager"],
    )
    assert (await cli.json("get-memory-entry", entry["id"]))["content"] == "No refunds above $500"
    assert (await cli.json("get-memory-write", first["write_id"]))["entry_id"] == entry["id"]
    assert (await cli.json("delete-memory-entry", entry["id"])) == {"id": entry["id"], "deleted": True}
    code, _, err = await cli("get-memory-entry", entry["id"])
    assert code == 1 and "RESOURCE_NOT_FOUND" in err


async def test_search_verb(cli: Cli, project_id: str, memory_id: str) -> None:
    for content in ("Customer prefers email over phone calls", "The customer lives in Porto"):
        await cli.json("create-memory-entry", "--memory-id", memory_id, "--content", content)
    found = await cli.json(
        "search",
        "--query",
        "Does the customer prefer email or phone?",
        "--memory-ids",
        memory_id,
        "--limit",
        "1",
        "--project-id",
        project_id,
    )
    [best] = found["results"]
    assert best["content"] == "Customer prefers email over phone calls" and best["score"] > 0.5
    by_tag = await cli.json("search", "--memory-tags", '["crm", "nothing"]', "--project-id", project_id)
    assert [r["content"] for r in by_tag["results"]] == [
        "Customer prefers email over phone calls",
        "The customer lives in Porto",
    ]
    assert "score" not in by_tag["results"][0]
    code, table, _ = await cli(
        "search",
        "--query",
        "Which city?",
        "--memory-ids",
        memory_id,
        "--project-id",
        project_id,
        "--min-score",
        "0.2",
    )
    assert code == 0 and table.splitlines()[0].split() == ["SCORE", "ENTRY", "MEMORY", "CONTENT"]
    code, _, err = await cli("search", "--project-id", project_id)
    assert code == 1 and "VALIDATION_FAILED" in err


async def test_usage_errors_exit_2(cli: Cli, memory_id: str) -> None:
    code, _, err = await cli(
        "create-memory-entry", "--memory-id", memory_id, "--content", "x", "--tags", "a,b"
    )
    assert code == 2 and "not JSON" in err and """write it as '["customer", "crm"]', got 'a,b'""" in err
    code, _, err = await cli("update-memory-entry", "mem_entry_0000000000000000")
    assert code == 2 and "nothing to change: give at least one of --content, --tags, --metadata" in err
    code, _, err = await cli(
        "create-memory-entry", "--memory-id", memory_id, "--content", "x", "--tags", '{"a": 1}'
    )
    assert code == 2 and "JSON array of strings" in err
    code, _, err = await cli("create-memory", "--project-id", "proj_x")
    assert code == 2 and "--name" in err
    # The admin token must name a project: said as the flag to pass, not only as a body field that is missing.
    code, _, err = await cli("create-memory", "--name", "foo")
    assert code == 1 and "pass --project-id: the admin token acts in every project" in err
    for option in (["create-memory-entry", "--memory-id", memory_id, "--content", "x", "--duplicate-threshold", "nan"],
                   ["search", "--query", "x", "--min-score", "inf"]):
        code, _, err = await cli(*option)
        assert code == 2 and "finite number" in err, err
    code, _, err = await cli("import", "/no/such/file.jsonl")
    assert code == 2 and "cannot read" in err
    code, _, err = await cli.raw("get-memory", "mem_a", "--url", "notaurl", "--token", ADMIN_TOKEN)
    assert code == 2 and "INVALID_REQUEST" in err, err
    # null clears --description, --tags, --metadata; a name or a fact's content cannot be cleared, and was stored
    # as the word "null" (the fact re-embedded) by a user following that rule.
    for verb, option in (("update-memory", "--name"), ("update-memory-entry", "--content")):
        code, _, err = await cli(verb, "mem_x" if verb == "update-memory" else "mem_entry_x", option, "null")
        assert code == 2 and "cannot be cleared" in err, err
    code, _, err = await cli("create-memory-entry", "--memory-id", memory_id, "--content", "x", "--metadata", '{"a": NaN}')
    assert code == 2 and "NaN is not a JSON number" in err
    # Refused by the client before anything is sent: a header value that is not ASCII, an empty id.
    # Any key the service would refuse, not only one that cannot be sent: "" and "a b" were its 400s (exit 1).
    for key in ("ключ", "clé", "", "a b"):
        code, _, err = await cli(
            "create-memory-entry", "--memory-id", memory_id, "--content", "x", "--idempotency-key", key
        )
        assert code == 2 and "INVALID_REQUEST: an Idempotency-Key must be 1 to 255 visible ASCII" in err, (key, err)
    code, _, err = await cli("get-memory", "")
    assert code == 2 and "INVALID_REQUEST" in err
    assert (await cli.json("list-memory-entries", "--memory-id", memory_id))["total"] == 0


async def test_import_twice_writes_nothing_twice(
    cli: Cli, memory_id: str, project_id: str, tmp_path: Path
) -> None:
    other = (await cli.json("create-memory", "--project-id", project_id, "--name", "Other"))["id"]
    lines = [
        {"memory_id": memory_id, "content": "Customer prefers email over phone calls", "tags": ["channel"]},
        {"memory_id": other, "content": "The customer lives in Porto", "metadata": {"source": "crm"}},
        {"memory_id": memory_id, "content": "customer prefers email over phone calls."},  # a known fact
        {"memory_id": memory_id, "content": "Budget is 40,000 euros", "idempotency_key": "budget-1"},
        {"memory_id": other, "content": "The customer rides a tandem", "idempotency_key": ""},  # "" is no key
    ]
    source = tmp_path / "facts.jsonl"
    source.write_text(
        "\n".join(json.dumps(line) for line in lines[:2])
        + "\n\n"
        + "\n".join(json.dumps(line) for line in lines[2:])
        + "\n"
    )

    code, out, err = await cli("import", str(source))
    assert code == 0, err
    # The blank line is not counted, and said so: the failures' numbers count it (the file's line numbers).
    assert out.strip() == "5 lines: 4 created, 1 skipped (0 already imported), 0 failed; 1 blank line ignored"
    # Into a pipe (the test captures it), the bar's last state as a line of its own, no carriage returns.
    assert "\r" not in err and f"\n[{'#' * 30}] 5/5  created 4  skipped 1  failed 0\n" in f"\n{err}"

    code, out, err = await cli("import", str(source), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["created"], summary["skipped"], summary["already_imported"], summary["failed"]) == (0, 5, 5, 0)
    entries = (await cli.json("list-memory-entries", "--memory-id", memory_id))["data"]
    assert [e["content"] for e in entries] == [
        "Customer prefers email over phone calls",
        "Budget is 40,000 euros",
    ]
    assert entries[0]["tags"] == ["channel"]
    assert (await cli.json("list-memory-entries", "--memory-id", other))["total"] == 2


def line_text(memory_id: str, content: str, more: str = "", close: str = "}") -> str:
    """An import line written by hand: what json.dumps would never write (NaN, a broken line)."""
    return '{"memory_id": ' + json.dumps(memory_id) + ', "content": ' + json.dumps(content) + more + close


async def test_an_import_run_again_after_a_fix_writes_again_only_the_fixed_line(
    cli: Cli, memory_id: str, tmp_path: Path
) -> None:
    facts = ["Paul lives in Paris", "Quinn works at Acme", "Paul lives in Paris"]
    source = tmp_path / "fix.jsonl"
    lines = [json.dumps({"memory_id": memory_id, "content": fact}) for fact in facts]
    source.write_text("\n".join([*lines, line_text(memory_id, "Rita rides", close="")]) + "\n")
    code, out, _ = await cli("import", str(source), "--json")
    assert code == 1 and (json.loads(out)["created"], json.loads(out)["skipped"]) == (2, 1)
    paul, quinn = (await cli.json("list-memory-entries", "--memory-id", memory_id))["data"]
    # Since the import, one fact was corrected and one deleted; then the broken line is fixed.
    await cli.json("update-memory-entry", paul["id"], "--content", "Paul moved to Berlin")
    assert (await cli("delete-memory-entry", quinn["id"]))[0] == 0
    source.write_text(source.read_text().replace('"Rita rides"', '"Rita rides"}'))
    code, out, err = await cli("import", str(source), "--json")
    assert code == 0, err
    summary = json.loads(out)
    assert (summary["created"], summary["already_imported"]) == (1, 3)
    contents = [e["content"] for e in (await cli.json("list-memory-entries", "--memory-id", memory_id))["data"]]
    assert contents == ["Paul moved to Berlin", "Rita rides"]


async def test_a_file_imported_by_the_previous_version_is_not_written_again(
    cli: Cli, memory_id: str, tmp_path: Path
) -> None:
    source = tmp_path / "old.jsonl"
    source.write_text(json.dumps({"memory_id": memory_id, "content": "Vera plays chess"}) + "\n")
    # Imported before lines had keys of their own: the file's hash and the line number; deleted since.
    earlier_key = f"import:{file_digest(source.read_bytes())}:1"
    async with AsyncMemoriesClient(cli.url, ADMIN_TOKEN) as admin:  # async: the writers run on this loop
        written = await admin.create_entry(memory_id, "Vera plays chess", idempotency_key=earlier_key)
        assert written.entry is not None
        await admin.delete_entry(written.entry.id)
    code, out, err = await cli("import", str(source), "--json")
    assert code == 0, err
    assert (json.loads(out)["created"], json.loads(out)["already_imported"]) == (0, 1)
    assert (await cli.json("list-memory-entries", "--memory-id", memory_id))["total"] == 0


async def test_an_import_line_not_decided_in_time_is_named_with_its_write(
    settings: Settings, memory_id: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    source = tmp_path / "slow.jsonl"
    source.write_text(json.dumps({"memory_id": memory_id, "content": "Wanda waits for her write"}) + "\n")
    with serve_api(settings.model_copy(update={"memories_write_timeout_s": 0.5})) as impatient_api:
        async with sessions() as holder, holder.begin():  # the memory is busy: its write waits past the timeout
            await repo.lock_memories(holder, [memory_id])
            code, out, err = await Cli(impatient_api, capsys)("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 0 and summary["pending"] == 1
    [pending] = summary["pending_writes"]
    assert pending["line"] == 1 and f"memories get-memory-write {pending['write_id']}" in err


async def test_a_pending_write_prints_every_field_of_the_write(
    settings: Settings, memory_id: str, capsys: pytest.CaptureFixture[str], sessions: async_sessionmaker[AsyncSession],
) -> None:
    # Printed without its empty fields: the README's `action`, `replayed` and `entry` were missing, not null/false.
    with serve_api(settings.model_copy(update={"memories_write_timeout_s": 0.5})) as impatient_api:
        async with sessions() as holder, holder.begin():  # the memory is busy: its write waits past the timeout
            await repo.lock_memories(holder, [memory_id])
            code, out, err = await Cli(impatient_api, capsys)(
                "create-memory-entry", "--memory-id", memory_id, "--content", "Xavier waits too", "--json"
            )
    assert code == 0, err
    written = json.loads(out)
    assert written == {"write_id": written["write_id"], "status": "pending", "action": None, "entry": None,
                       "replayed": False}


async def test_an_import_line_that_cannot_be_sent_fails_alone(cli: Cli, memory_id: str, tmp_path: Path) -> None:
    source = tmp_path / "odd.jsonl"
    good = {"memory_id": memory_id, "content": "Alice likes tea"}
    source.write_text("\n".join([
        json.dumps(good),
        json.dumps({**good, "content": "Bob", "idempotency_key": "ключ"}, ensure_ascii=False),
        line_text(memory_id, "Carol", ', "metadata": {"a": NaN}'),
        line_text(memory_id, "Dan", ', "metadata": {"n": ' + "9" * 5000 + "}"),
        line_text(memory_id, "Eve", ', "metadata": ' + "[" * 100_000 + "]" * 100_000),
        json.dumps({**good, "content": "Frank has a cat"}),
    ]))
    code, out, _ = await cli("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 1 and (summary["created"], summary["failed"]) == (2, 4)
    assert [(f["line"], f["error"].split(":")[0]) for f in summary["failures"]] == [
        (2, "INVALID_REQUEST"), (3, "not usable JSON"), (4, "not usable JSON"), (5, "not usable JSON")
    ]


async def test_failures_past_the_listed_ones_are_counted(cli: Cli, memory_id: str, tmp_path: Path) -> None:
    source = tmp_path / "bad.jsonl"
    source.write_text("\n".join(f"bad {n}" for n in range(150)))
    code, out, err = await cli("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 1 and summary["failed"] == 150 and summary["failures_not_listed"] == 50
    assert [f["line"] for f in summary["failures"]] == list(range(1, 101))
    assert "… and 50 more failed lines, not listed" in err


def test_the_lowest_numbered_failures_are_listed() -> None:
    summary = ImportSummary()
    for number in range(150, 0, -1):  # lines of concurrent memories fail out of order
        summary.fail(number, "bad")
    assert [number for number, _ in summary.listed_failures] == list(range(1, 101))
    assert summary.unlisted_failures == 50


async def test_an_unreachable_service_stops_the_import_at_once(cli: Cli, tmp_path: Path) -> None:
    source = tmp_path / "many.jsonl"
    source.write_text("not json\n" + "".join(json.dumps({"memory_id": f"mem_{n}", "content": "x"}) + "\n" for n in range(150)))
    code, out, err = await cli.raw("import", str(source), "--url", f"http://{LOOPBACK}:{free_port()}", "--token", "t")
    # Was 100 "line N: CONNECTION_FAILED" and "… and 50 more failed lines".
    assert code == 1 and err.count("CONNECTION_FAILED") == 1, err
    assert "stopped after 1 of 151 lines: run the same import again" in err
    # What was learnt before it stopped is reported all the same: the line to fix, and the summary.
    assert "line 1: " in err and "line 2:" not in err, err
    assert out.startswith("1 of 151 lines: 0 created") and "1 failed, 150 not sent" in out, out
    assert f"is the service running at http://{LOOPBACK}:" in err


async def test_a_refused_token_stops_the_import_at_once(cli: Cli, api_url: str, tmp_path: Path) -> None:
    # Every line was sent and listed as failed, one UNAUTHORIZED each, as if each line were wrong.
    source = tmp_path / "refused.jsonl"
    source.write_text("".join(json.dumps({"memory_id": f"mem_{n}", "content": "x"}) + "\n" for n in range(50)))
    code, out, err = await cli.raw("import", str(source), "--url", api_url, "--token", "not-the-token", "--json")
    assert code == 1 and err.count("UNAUTHORIZED") == 1, err
    assert "stopped after 0 of 50 lines: run the same import again once the token is one it takes" in err
    assert json.loads(out)["not_sent"] == 50


@pytest.mark.parametrize(
    ("text", "failures", "blank"),
    [
        ('{"content": "x"}', [(1, "missing fields: memory_id")], 0),  # was "memory_id and content must be strings"
        ('{"memory_id": "m", "content": 5}', [(1, "content must be a string")], 0),
        ('\ufeff{"memory_id": "m", "content": "x"}\n', [], 0),  # the byte order mark some editors write
        (
            '{"memory_id": "m", "content": "x"}\n\ufeff{"memory_id": "m", "content": "y"}',
            [(2, "starts with a byte order mark (U+FEFF), as a file may: another file joined here?")],
            0,
        ),
        ('\n  \n{"memory_id": "m", "content": "x"}\r\n', [], 2),  # the last line end starts no blank line
        ("", [], 0),
    ],
)
def test_import_lines_as_their_editor_numbers_them(text: str, failures: list[tuple[int, str]], blank: int) -> None:
    summary = ImportSummary()
    parse_lines(text, summary)
    assert (summary.listed_failures, summary.blank) == (failures, blank)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_bar_is_drawn_once_per_change_within_80_columns() -> None:
    drawn = Terminal()
    bar, empty = ProgressBar(drawn), ImportSummary()
    bar.update(empty)
    bar.update(empty, final=True)
    assert drawn.getvalue() == f"\r[{'#' * 30}] 0/0  created 0  skipped 0  failed 0\n"  # an empty file's, once
    drawn = Terminal()
    large = ImportSummary(total=999_999, counts=Counter(created=333_333, skipped=333_333, failed=333_333))
    ProgressBar(drawn).update(large, final=True)
    line = drawn.getvalue().strip("\r\n")
    assert len(line) < 80 and line.endswith("] 999999/999999  created 333333  skipped 333333  failed 333333"), line


def test_the_progress_bar_writes_lines_into_a_file_not_carriage_returns() -> None:
    # A CI log held every redraw on one line of carriage returns.
    logged, summary = io.StringIO(), ImportSummary(total=3)
    bar = ProgressBar(logged)
    for outcome in ("created", "created", "skipped"):
        summary.counts[outcome] += 1
        bar.update(summary)  # within 10 s of the start: not written
    bar.update(summary, final=True)
    assert logged.getvalue() == f"[{'#' * 30}] 3/3  created 2  skipped 1  failed 0\n"


async def test_import_reads_stdin_and_a_line_of_no_utf8_fails_alone(
    cli: Cli, memory_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One byte that is no UTF-8 refused the whole file (exit 2), where a bad line should fail alone; `-` was
    read as a file named "-"."""
    good = json.dumps({"memory_id": memory_id, "content": "Read from standard input"}).encode()
    bad = b'{"memory_id": "' + memory_id.encode() + b'", "content": "caf\xe9 latin-1"}'
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(good + b"\n" + bad + b"\n")))
    code, out, err = await cli("import", "-")
    assert code == 1, err
    assert out.strip() == "2 lines: 1 created, 0 skipped (0 already imported), 1 failed"
    assert "line 2: not UTF-8 text" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(good)))
    code, out, _ = await cli("import", "-")
    assert out.strip() == "1 line: 0 created, 1 skipped (1 already imported), 0 failed"
    code, _, err = await cli("import", "-", "--concurrency", "0")
    assert code == 2 and "must be 1 or more" in err


async def test_a_key_that_may_only_write_can_import(cli: Cli, memory_id: str, project_id: str, tmp_path: Path) -> None:
    async with AsyncMemoriesClient(cli.url, ADMIN_TOKEN) as admin:
        key = (await admin.create_api_key(project_id, ["memories:CreateMemoryEntry"])).key
    source = tmp_path / "writer.jsonl"
    lines = [{"memory_id": memory_id, "content": "Written by a narrow key"},
             {"memory_id": memory_id, "content": "Deleted before the re-run"}]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    code, out, err = await cli.raw("import", str(source), "--json", "--url", cli.url, "--token", key)
    assert code == 0, err
    first = json.loads(out)
    assert first["created"] == 2
    entries = (await cli.json("list-memory-entries", "--memory-id", memory_id))["data"]
    [gone] = [e["id"] for e in entries if e["content"] == "Deleted before the re-run"]
    assert (await cli("delete-memory-entry", gone))[0] == 0
    # Run again: the key cannot read whether a line was imported, but the service says each answer repeats the
    # first outcome (Idempotent-Replayed). Before, it counted both lines "created" again and the deleted one failed.
    code, out, err = await cli.raw("import", str(source), "--json", "--url", cli.url, "--token", key)
    again = json.loads(out)
    assert code == 0, err
    assert (again["created"], again["skipped"], again["already_imported"], again["failed"]) == (0, 2, 2, 0), again


async def test_import_counts_bad_lines_as_failed(cli: Cli, memory_id: str, tmp_path: Path) -> None:
    source = tmp_path / "mixed.jsonl"
    source.write_text(
        "\n".join(
            [
                json.dumps({"memory_id": memory_id, "content": "A good fact"}),
                "{not json",
                json.dumps({"memory_id": memory_id, "contents": "a typo"}),
                json.dumps({"memory_id": "mem_0000000000000000", "content": "no such memory"}),
            ]
        )
    )
    code, out, err = await cli("import", str(source), "--json")
    assert code == 1
    summary = json.loads(out)
    assert (summary["created"], summary["failed"]) == (1, 3)
    assert [f["line"] for f in summary["failures"]] == [2, 3, 4]
    assert "line 3: unknown fields: contents" in err and "line 4: RESOURCE_NOT_FOUND" in err


async def test_import_reads_the_file_as_its_editor_shows_it(cli: Cli, memory_id: str, tmp_path: Path) -> None:
    # A byte order mark, Windows line ends, and line separators that JSON allows unescaped inside strings.
    lines = [
        json.dumps({"memory_id": memory_id, "content": "Wiki page\u2028second paragraph"}, ensure_ascii=False),
        json.dumps({"memory_id": memory_id, "content": "Legacy\u0085export"}, ensure_ascii=False),
        json.dumps({"memory_id": memory_id, "content": "   "}),
        json.dumps({"memory_id": memory_id, "content": "Line four is fine"}),
    ]
    source = tmp_path / "editor.jsonl"
    source.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n")
    code, out, err = await cli("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 1 and (summary["lines"], summary["created"], summary["failed"]) == (4, 3, 1), err
    # The failure names its line as the file numbers it, and the field the service refused.
    assert summary["failures"] == [{"line": 3, "error": summary["failures"][0]["error"]}]
    assert "VALIDATION_FAILED" in summary["failures"][0]["error"] and "content" in summary["failures"][0]["error"]
    contents = [e["content"] for e in (await cli.json("list-memory-entries", "--memory-id", memory_id))["data"]]
    assert "Wiki page\u2028second paragraph" in contents and "Legacy\u0085export" in contents


async def test_import_refuses_a_key_first_used_for_another_line(cli: Cli, memory_id: str, tmp_path: Path) -> None:
    source = tmp_path / "keys.jsonl"
    first = {"memory_id": memory_id, "content": "Lunch is at noon", "idempotency_key": "crm-42"}
    source.write_text(json.dumps(first) + "\n" + json.dumps({**first, "content": "Dinner is at eight"}) + "\n")
    code, out, _ = await cli("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 1 and (summary["created"], summary["skipped"], summary["failed"]) == (1, 0, 1)
    assert summary["failures"][0]["line"] == 2 and summary["failures"][0]["error"].startswith("CONFLICT")
    # A re-run still counts the first line as imported, and still refuses the second.
    code, out, _ = await cli("import", str(source), "--json")
    summary = json.loads(out)
    assert code == 1 and (summary["already_imported"], summary["failed"]) == (1, 1)


async def test_connection_settings(
    api_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cli = Cli(api_url, capsys)
    nowhere = f"http://{LOOPBACK}:{free_port()}"
    code, _, err = await cli.raw("list-projects", "--url", nowhere, "--token", "x")
    assert code == 1 and "CONNECTION_FAILED" in err and f"is the service running at {nowhere}?" in err
    code, _, err = await cli.raw("list-projects", "--url", api_url, "--token", "not-the-token")
    assert code == 1 and "UNAUTHORIZED" in err
    # Neither --url nor --token: MEMORIES_URL, and the admin token file a local `memories up` wrote.
    (tmp_path / "admin_token").write_text(ADMIN_TOKEN + "\n")
    monkeypatch.setenv("MEMORIES_URL", api_url)
    monkeypatch.setenv("MEMORIES_DATA_DIR", str(tmp_path))
    monkeypatch.delenv("MEMORIES_TOKEN", raising=False)
    get_settings.cache_clear()
    try:
        code, out, err = await cli.raw("list-projects", "--json", "--limit", "1")
        assert code == 0, err
        assert json.loads(out)["limit"] == 1
        monkeypatch.setenv("MEMORIES_TOKEN", "not-the-token")
        get_settings.cache_clear()
        code, _, err = await cli.raw("list-projects")
        assert code == 1 and "UNAUTHORIZED" in err  # the variable wins over the file
        # What a local run was started with, and nothing else: its port and its admin token.
        monkeypatch.delenv("MEMORIES_URL")
        monkeypatch.delenv("MEMORIES_TOKEN")
        monkeypatch.setenv("MEMORIES_PORT", api_url.rsplit(":", 1)[1])
        monkeypatch.setenv("MEMORIES_ADMIN_TOKEN", ADMIN_TOKEN)
        (tmp_path / "admin_token").write_text("a stale token of an earlier run\n")
        get_settings.cache_clear()
        code, out, err = await cli.raw("list-projects", "--json", "--limit", "1")
        assert code == 0, err
        # `memories up --port`, MEMORIES_PORT unset: the address the run noted in its data directory.
        monkeypatch.delenv("MEMORIES_PORT")
        (tmp_path / "api_url").write_text(api_url)
        get_settings.cache_clear()
        code, out, err = await cli.raw("list-projects", "--json", "--limit", "1")
        assert code == 0, err
        # MEMORIES_PORT set wins over a noted address (one a run killed outright left behind).
        monkeypatch.setenv("MEMORIES_PORT", api_url.rsplit(":", 1)[1])
        (tmp_path / "api_url").write_text(f"http://{LOOPBACK}:{free_port()}")
        get_settings.cache_clear()
        code, out, err = await cli.raw("list-projects", "--json", "--limit", "1")
        assert code == 0, err
        # No token given or found: said before anything is sent, with what to do (the service's 401 says neither).
        monkeypatch.delenv("MEMORIES_ADMIN_TOKEN")
        (tmp_path / "admin_token").unlink()
        get_settings.cache_clear()
        code, _, err = await cli.raw("list-projects")
        assert code == 2 and "no token: pass --token or set MEMORIES_TOKEN" in err and "MEMORIES_DATA_DIR" in err
        # A service elsewhere is sent neither the local run's admin token nor its token file, and that is said.
        (tmp_path / "admin_token").write_text(ADMIN_TOKEN + "\n")
        monkeypatch.setattr(cli_resources, "_LOOPBACK_HOSTS", frozenset())  # as if api_url were another machine
        code, _, err = await cli.raw("list-projects", "--url", api_url)
        assert code == 2 and f"no token for {api_url}" in err and "this machine only" in err
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


async def test_stored_text_cannot_drive_the_terminal(cli: Cli, memory_id: str) -> None:
    hostile = "Ordinary text\x1b]0;pwned\x07\x1b[31m red"
    entry = await cli.json("create-memory-entry", "--memory-id", memory_id, "--content", hostile)
    for verb in (["get-memory-entry", entry["entry"]["id"]], ["list-memory-entries", "--memory-id", memory_id]):
        code, out, _ = await cli(*verb)
        assert code == 0 and "Ordinary text" in out and "\x1b" not in out and "\x07" not in out, verb
    # Only controls are replaced: no-break spaces, joiners and right-to-left text are text.
    text = "Prix\u00a0: 10\u202f000\u00a0€ — مرحبا 👨\u200d👩\u200d👧 \x9b31m"
    kept = await cli.json("create-memory-entry", "--memory-id", memory_id, "--content", text)
    code, out, _ = await cli("get-memory-entry", kept["entry"]["id"])
    assert code == 0 and text[:-5] in out and "\x9b" not in out
    code, out, _ = await cli("get-memory-entry", kept["entry"]["id"], "--json")
    assert code == 0 and "\x9b" not in out and json.loads(out)["content"] == text  # escaped, not lost


async def test_an_entry_with_its_source_type_and_this_writes_policy(cli: Cli, memory_id: str) -> None:
    written = await cli.json("create-memory-entry", "--memory-id", memory_id, "--content", "Tom is 30 and Ann is 25",
                             "--source-type", "agent", "--write-policy", "guarded")
    assert written["action"] == "created" and written["entry"]["source_type"] == "agent"
    swapped = await cli.json("create-memory-entry", "--memory-id", memory_id, "--content", "Tom is 25 and Ann is 30",
                             "--write-policy", "guarded")
    assert swapped["action"] == "created"  # the guard sees the swap that the seed rule would skip
    code, _, err = await cli("create-memory-entry", "--memory-id", memory_id, "--content", "x", "--write-policy", "bold")
    assert code == 2 and "invalid choice" in err


def test_an_invalid_setting_is_named_not_a_traceback() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "MEMORIES_PORT": "abc"}
    done = subprocess.run([sys.executable, "-m", "services.cli", "bus", "init"], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2 and "invalid setting MEMORIES_PORT" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_tables_line_up_wide_and_combining_characters(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"content": "東京に住んでいる", "memory": "m1"},
        {"content": "likes 🍣 and 🍵", "memory": "m2"},
        {"content": "Cafe\u0301 au lait", "memory": "m3"},  # é as e and a combining accent
        {"content": "plain", "memory": "m4"},
    ]
    print_table(rows, [("CONTENT", lambda row: row["content"]), ("MEMORY", lambda row: row["memory"])])
    lines = capsys.readouterr().out.splitlines()
    # Each MEMORY value starts at the same terminal column as its header.
    starts = {display_width(line[: line.index(marker)]) for line, marker in zip(lines, ["MEMORY", "m1", "m2", "m3", "m4"])}
    assert len(starts) == 1 and starts == {display_width("東京に住んでいる") + 2}


def test_a_long_wide_cell_is_cut_to_its_columns(capsys: pytest.CaptureFixture[str]) -> None:
    print_table([{"content": "漢" * 100}], [("CONTENT", lambda row: row["content"])])
    cell = capsys.readouterr().out.splitlines()[1]
    assert cell.endswith("…") and display_width(cell) <= 60


def test_output_cut_short_by_its_reader_ends_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from services import cli

    # `memories … | head`: the reader has left; what is left to print must not end in a BrokenPipeError traceback.
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w", closefd=True) as gone:
        monkeypatch.setattr("sys.stdout", gone)
        assert cli.main(["openapi", "--output", "-"]) == 141


def test_the_cli_loads_neither_the_bus_nor_the_model_nor_the_database_driver_to_start() -> None:
    # Every `memories` call registers every verb: nats-py (with aiohttp), numpy and psycopg cost ~0.35 s a call, the
    # REST verbs' included, which use none of them.
    probe = ("import sys; from services.cli import build_parser; build_parser(); "
             "print(sorted(m for m in ('nats', 'aiohttp', 'numpy', 'psycopg', 'sqlalchemy') if m in sys.modules))")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60)
    assert loaded.stdout.strip() == "[]", loaded.stdout
