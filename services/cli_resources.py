"""REST resources from the command line: create-memory, list-memories, … (the seed's verbs), and `import`.

Every verb talks to the service at `--url` (MEMORIES_URL) with `--token` (MEMORIES_TOKEN, else the local
run's admin token file). `--json` prints the API's JSON; otherwise a table. A failed call prints the error's
code and message on stderr and exits 1; a bad argument exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel

from shared.client import (
    UNSET,
    AsyncMemoriesClient,
    ConnectionFailed,
    InvalidRequest,
    MemoriesClient,
    MemoriesError,
    Page,
    SourceType,
    TimedOut,
    Unauthorized,
    WritePolicy,
)
from shared.client.bulk import ImportSummary, ProgressBar, file_digest, import_lines, parse_lines, strict_json
from shared.local_run import local_api_url
from shared.settings import get_settings

Command = Callable[[MemoriesClient, argparse.Namespace], Any]
Column = tuple[str, Callable[[dict[str, Any]], Any]]

_CELL_WIDTH = 60

MEMORY_COLUMNS: list[Column] = [
    ("ID", lambda m: m["id"]),
    ("NAME", lambda m: m["name"]),
    ("TAGS", lambda m: ",".join(m["tags"] or [])),
    ("PROJECT", lambda m: m["project_id"]),
]
ENTRY_COLUMNS: list[Column] = [
    ("ID", lambda e: e["id"]),
    ("CONTENT", lambda e: e["content"]),
    ("TAGS", lambda e: ",".join(e["tags"] or [])),
    ("SOURCE", lambda e: e["source_type"]),
    ("INVALIDATED", lambda e: "yes" if e["invalidated_at"] else ""),
]
RESULT_COLUMNS: list[Column] = [
    ("SCORE", lambda r: "" if r.get("score") is None else f"{r['score']:.3f}"),
    ("ENTRY", lambda r: r["entry_id"]),
    ("MEMORY", lambda r: r["memory_name"]),
    ("CONTENT", lambda r: r["content"]),
]
PROJECT_COLUMNS: list[Column] = [("ID", lambda p: p["id"]), ("NAME", lambda p: p["name"])]


# Argument types: a bad value is a usage error (exit 2) --------------------------------------------


def _json_value(text: str, example: str) -> Any:
    try:
        return strict_json(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc.msg}): write it as {example}, got {text!r}") from None
    except ValueError as exc:  # NaN, a number of 5,000 digits, nesting past Python's stack
        raise argparse.ArgumentTypeError(f"not usable JSON: {exc}") from None


TAGS_EXAMPLE = """'["customer", "crm"]'"""
METADATA_EXAMPLE = """'{"evidence": "high"}'"""


def json_array(text: str) -> list[str] | None:
    """A JSON array of strings, as in the seed (`--tags '["customer", "crm"]'`); `null` clears on update."""
    value = _json_value(text, TAGS_EXAMPLE)
    if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise argparse.ArgumentTypeError(f"expected a JSON array of strings, e.g. {TAGS_EXAMPLE}")
    return value


def json_object(text: str) -> dict[str, Any] | None:
    value = _json_value(text, METADATA_EXAMPLE)
    if value is not None and not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, e.g. {METADATA_EXAMPLE}")
    return value


POLICIES = [policy.value for policy in WritePolicy]


def nullable_text(text: str) -> str | None:
    """A text option of an update, where the JSON `null` clears the field (as for --tags and --metadata)."""
    return None if text == "null" else text


def kept_text(text: str) -> str:
    """A text option of an update for a field that cannot be cleared (a name, an entry's content): `null`, which
    clears the other fields, is refused rather than stored as the word."""
    if text == "null":
        raise argparse.ArgumentTypeError("this field cannot be cleared (null clears only the fields that say so)")
    return text


def positive_int(text: str) -> int:
    value = int(text)  # argparse turns its ValueError into a usage error
    if value < 1:
        raise argparse.ArgumentTypeError("must be 1 or more")
    return value


def finite_number(text: str) -> float:
    value = float(text)  # argparse turns its ValueError into a usage error
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, not {text}")
    return value


def _printable(text: str) -> str:
    # Stored text may come from agents and extraction: no control character of it (ESC, BEL, C1 codes)
    # reaches the terminal. Only controls: no-break spaces, joiners and direction marks are text.
    return "".join("\ufffd" if unicodedata.category(ch) == "Cc" and ch not in "\n\t" else ch for ch in text)


def _json_for_terminal(data: Any) -> str:
    # json.dumps escapes the C0 controls itself; DEL and the C1 controls it leaves raw are escaped here.
    text = json.dumps(data, indent=2, ensure_ascii=False)
    return "".join(f"\\u{ord(ch):04x}" if "\x7f" <= ch <= "\x9f" else ch for ch in text)


def one_or_many(text: str) -> list[str]:
    """A filter value: a plain string, or a JSON array of them."""
    if text.lstrip().startswith("["):
        return json_array(text) or []
    return [text]


class Values(argparse.Action):
    """`--tags a* b?` or `--tags '["a*", "b?"]'`, repeatable: one flat list of the values."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        items = list(getattr(namespace, self.dest) or [])
        for value in values:
            items.extend(value)
        setattr(namespace, self.dest, items)


# Output -------------------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    # Only the fields the service sent: a search without a query has no score rather than a null one.
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_unset=True)
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def _columns_of(char: str) -> int:
    """Terminal columns a character takes: two for wide ones (CJK, most emoji), none for combining marks and
    joiners, one otherwise."""
    if unicodedata.combining(char) or unicodedata.category(char) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(char) in ("W", "F") else 1


def display_width(text: str) -> int:
    return sum(_columns_of(char) for char in text)


def _pad(text: str, width: int) -> str:
    return text + " " * (width - display_width(text))


def _cell(value: Any) -> str:
    text = " ".join(_printable(str(value if value is not None else "")).split())
    if display_width(text) <= _CELL_WIDTH:
        return text
    kept, used = [], 0
    for char in text:
        used += _columns_of(char)
        if used > _CELL_WIDTH - 1:  # a column left for the ellipsis
            break
        kept.append(char)
    return "".join(kept) + "…"


def print_table(rows: Iterable[dict[str, Any]], columns: Sequence[Column]) -> None:
    cells = [[_cell(get(row)) for _, get in columns] for row in rows]
    widths = [
        max([display_width(header), *(display_width(line[i]) for line in cells)])
        for i, (header, _) in enumerate(columns)
    ]
    for line in [[header for header, _ in columns], *cells]:
        print("  ".join(_pad(cell, width) for cell, width in zip(line, widths, strict=True)).rstrip())


def print_record(record: dict[str, Any]) -> None:
    width = max(map(display_width, record), default=0)
    for name, value in record.items():
        shown = json.dumps(value, ensure_ascii=False) if isinstance(value, dict | list) else value
        print(f"{_pad(name, width)}  {'' if shown is None else _printable(str(shown))}")


def show(result: Any, args: argparse.Namespace, columns: Sequence[Column] | None = None) -> None:
    data = _plain(result)
    if args.json:
        print(_json_for_terminal(data))
    elif isinstance(result, Page) and columns:
        print_table(data["data"], columns)
        print(f"({len(data['data'])} of {data['total']}, offset {data['offset']})")
    elif isinstance(data, list) and columns:
        print_table(data, columns)
    elif isinstance(data, dict):
        print_record(data)


# Verbs --------------------------------------------------------------------------------------------


def _changes(args: argparse.Namespace, names: Sequence[str]) -> dict[str, Any]:
    """The options given on the command line; left-out ones are UNSET, so the update keeps those fields. None
    given is a usage error: the verb would succeed and change nothing."""
    changes = {name: getattr(args, name) for name in names if getattr(args, name) is not UNSET}
    if not changes:
        options = ", ".join(f"--{name.replace('_', '-')}" for name in names)
        raise InvalidRequest(None, "INVALID_REQUEST", f"nothing to change: give at least one of {options}")
    return changes


def _deleted(identifier: str, args: argparse.Namespace) -> None:
    print(json.dumps({"id": identifier, "deleted": True}) if args.json else f"deleted {identifier}")


def delete_memory(client: MemoriesClient, args: argparse.Namespace) -> None:
    client.delete_memory(args.id)
    _deleted(args.id, args)


def delete_entry(client: MemoriesClient, args: argparse.Namespace) -> None:
    client.delete_entry(args.id)
    _deleted(args.id, args)


def create_memory(client: MemoriesClient, args: argparse.Namespace) -> None:
    memory = client.create_memory(
        args.name, project_id=args.project_id, description=args.description, tags=args.tags,
        write_policy=args.write_policy,
    )
    show(memory, args)


def create_entry(client: MemoriesClient, args: argparse.Namespace) -> None:
    written = client.create_entry(
        args.memory_id,
        args.content,
        tags=args.tags,
        metadata=args.metadata,
        duplicate_threshold=args.duplicate_threshold,
        source_type=args.source_type,
        write_policy=args.write_policy,
        idempotency_key=args.idempotency_key,
    )
    if args.json or written.entry is None:
        # Every field, also those a pending write leaves empty (README): `jq .replayed` is false, not null.
        show(written.model_dump(mode="json"), args)
    else:
        replayed = ", a replay of an earlier write with this key: nothing written now" if written.replayed else ""
        print(f"{written.action}: {written.entry.id}  (write {written.write_id}{replayed})")


def search(client: MemoriesClient, args: argparse.Namespace) -> None:
    results = client.search(
        args.query,
        memory_ids=args.memory_ids,
        memory_tags=args.memory_tags,
        limit=args.limit,
        min_score=args.min_score,
        project_id=args.project_id,
    )
    show({"results": _plain(results)} if args.json else results, args, RESULT_COLUMNS)


VERBS: dict[str, Command] = {
    "create-project": lambda c, a: show(c.create_project(a.name), a),
    "list-projects": lambda c, a: show(c.list_projects(limit=a.limit, offset=a.offset), a, PROJECT_COLUMNS),
    "create-memory": create_memory,
    "list-memories": lambda c, a: show(
        c.list_memories(project_id=a.project_id, tags=a.tags, limit=a.limit, offset=a.offset),
        a,
        MEMORY_COLUMNS,
    ),
    "get-memory": lambda c, a: show(c.get_memory(a.id), a),
    "update-memory": lambda c, a: show(
        c.update_memory(a.id, **_changes(a, ("name", "description", "tags", "write_policy"))), a
    ),
    "delete-memory": delete_memory,
    "create-memory-entry": create_entry,
    "list-memory-entries": lambda c, a: show(
        c.list_entries(
            a.memory_id, include_invalidated=a.include_invalidated, limit=a.limit, offset=a.offset
        ),
        a,
        ENTRY_COLUMNS,
    ),
    "get-memory-entry": lambda c, a: show(c.get_entry(a.id), a),
    "update-memory-entry": lambda c, a: show(
        c.update_entry(a.id, **_changes(a, ("content", "tags", "metadata"))), a
    ),
    "delete-memory-entry": delete_entry,
    "get-memory-write": lambda c, a: show(c.get_write(a.id), a),
    "search": search,
}


# Connection and error handling --------------------------------------------------------------------


def connection(args: argparse.Namespace) -> tuple[str, str | None]:
    """`--url`/`--token`, else MEMORIES_URL/MEMORIES_TOKEN, else what a local `memories up` was started with: its
    port when MEMORIES_PORT is set, else the address it noted in its data directory (its `--port` included), and
    the admin token (MEMORIES_ADMIN_TOKEN, else the file it wrote)."""
    settings = get_settings()
    named_url: str | None = args.url or (settings.memories_url if "memories_url" in settings.model_fields_set else None)
    noted_url = None if "memories_port" in settings.model_fields_set else local_api_url(settings.data_dir)
    url = named_url or noted_url or f"http://127.0.0.1:{settings.memories_port}"
    token = args.token or settings.memories_token
    # The admin token of a local run (its variable, or the file it wrote) goes to this machine only, never to a
    # service named elsewhere.
    if not token and urlsplit(url).hostname in _LOOPBACK_HOSTS:
        token_file = settings.data_dir / "admin_token"
        token = settings.memories_admin_token or (token_file.read_text().strip() if token_file.is_file() else None)
    return url, token


_LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def without_token(url: str) -> str:
    """What to do when no token was given or found: said before anything is sent (the service's 401 says only
    that a header is missing)."""
    if urlsplit(url).hostname not in _LOOPBACK_HOSTS:
        return (f"no token for {url}: pass --token or set MEMORIES_TOKEN (a local run's admin token is sent to this "
                "machine only)")
    token_file = get_settings().data_dir / "admin_token"
    return ("no token: pass --token or set MEMORIES_TOKEN. No local run's admin token was found either: "
            f"MEMORIES_ADMIN_TOKEN is not set and {token_file} does not exist (set MEMORIES_DATA_DIR to the data "
            "directory of your `memories up`)")


def report(error: MemoriesError, url: str | None = None) -> int:
    """Exit 2 for a request that could not be sent as given (a bad argument), 1 for a failed call."""
    print(f"error: {error.code}: {error.message}", file=sys.stderr)
    if error.meta:
        print(json.dumps(error.meta, ensure_ascii=False), file=sys.stderr)
    if isinstance(error, ConnectionFailed) and not isinstance(error, TimedOut) and url:
        print(f"is the service running at {url}? (`memories up`, or name it with --url or MEMORIES_URL)", file=sys.stderr)
    if "project_id" in error.meta.get("missing_fields", ()):
        print("pass --project-id: the admin token acts in every project and names one on each call "
              "(`memories list-projects`); a project's API key (--token) names its own", file=sys.stderr)
    return 2 if isinstance(error, InvalidRequest) else 1


def run_verb(args: argparse.Namespace) -> int:
    url, token = connection(args)
    if token is None:
        print(f"memories {args.command}: {without_token(url)}", file=sys.stderr)
        return 2
    try:
        with MemoriesClient(url, token) as client:
            VERBS[args.command](client, args)
    except MemoriesError as error:
        return report(error, url)
    return 0


# Bulk import --------------------------------------------------------------------------------------


def run_import(args: argparse.Namespace) -> int:
    try:
        data = sys.stdin.buffer.read() if args.file == "-" else Path(args.file).read_bytes()
    except OSError as exc:
        print(f"error: cannot read {args.file}: {exc}", file=sys.stderr)
        return 2
    # Bytes that are no UTF-8 are kept as lone surrogates, so that the line holding them fails alone
    # (parse_lines), not the whole file.
    text = data.decode("utf-8", errors="surrogateescape")
    summary = ImportSummary()
    lines = parse_lines(text, summary, earlier_digest=file_digest(data))
    bar = ProgressBar()
    url, token = connection(args)
    if token is None:
        print(f"memories import: {without_token(url)}", file=sys.stderr)
        return 2

    async def run() -> None:
        async with AsyncMemoriesClient(url, token) as client:
            await import_lines(client, lines, summary, concurrency=args.concurrency, on_progress=bar.update)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        bar.update(summary, final=True)
        print(
            "interrupted: run the same import again to finish it (nothing is written twice)", file=sys.stderr
        )
        return 130
    except (ConnectionFailed, Unauthorized) as error:  # not one failure per line: every line left would fail alike
        bar.update(summary, final=True)
        report(error, url)
        _report_import(summary, args)  # what was learnt before: lines that are wrong, writes to look up
        cure = "the service can be reached" if isinstance(error, ConnectionFailed) else "the token is one it takes"
        print(
            f"stopped after {summary.done} of {summary.total} lines: run the same import again once {cure} "
            "(nothing is written twice)",
            file=sys.stderr,
        )
        return 1
    bar.update(summary, final=True)
    _report_import(summary, args)
    return 1 if summary.counts["failed"] else 0


def _report_import(summary: ImportSummary, args: argparse.Namespace) -> None:
    for number, reason in summary.listed_failures:
        print(f"line {number}: {reason}", file=sys.stderr)
    if summary.unlisted_failures:
        print(f"… and {summary.unlisted_failures} more failed lines, not listed", file=sys.stderr)
    for number, write_id in sorted(summary.pending):
        print(f"line {number}: not decided yet, write {write_id} (`memories get-memory-write {write_id}`)", file=sys.stderr)
    print(json.dumps(summary.as_json(), indent=2) if args.json else summary.describe())


# Parser -------------------------------------------------------------------------------------------


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url", help="the service (default: MEMORIES_URL, else a local run's http://127.0.0.1:$MEMORIES_PORT, 8000)"
    )
    common.add_argument(
        "--token",
        help="bearer token (default: MEMORIES_TOKEN, else a local run's admin token: MEMORIES_ADMIN_TOKEN or the "
        "admin_token file in MEMORIES_DATA_DIR, .memories)",
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON")
    return common


def _paging(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--limit", type=int, help="page size, 1..100 (default 50)")
    parser.add_argument("--offset", type=int)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Adds this module's verbs to the `memories` parser."""
    common = _common()

    def verb(name: str, help_text: str) -> argparse.ArgumentParser:
        parser: argparse.ArgumentParser = subparsers.add_parser(name, help=help_text, parents=[common])
        parser.set_defaults(func=run_verb)
        return parser

    def update_option(parser: argparse.ArgumentParser, name: str, **options: Any) -> None:
        parser.add_argument(name, default=UNSET, **options)

    parser = verb("create-project", "create a project (admin token)")
    parser.add_argument("--name", required=True)
    _paging(verb("list-projects", "list projects (admin token)"))

    parser = verb("create-memory", "create a memory")
    parser.add_argument("--project-id")
    parser.add_argument("--name", required=True)
    parser.add_argument("--description")
    parser.add_argument("--tags", type=json_array, help='a JSON array, e.g. \'["customer", "crm"]\'')
    parser.add_argument("--write-policy", choices=POLICIES, help="how near-copies are decided (default seed)")
    parser = verb("list-memories", "list memories, optionally by tag globs (* and ?; ORed)")
    parser.add_argument("--project-id")
    parser.add_argument("--tags", type=one_or_many, nargs="+", action=Values, metavar="GLOB")
    _paging(parser)
    verb("get-memory", "show a memory").add_argument("id")
    parser = verb("update-memory", "change the given fields of a memory")
    parser.add_argument("id")
    update_option(parser, "--name", type=kept_text)
    update_option(parser, "--description", type=nullable_text, help="null clears")
    update_option(parser, "--tags", type=json_array, help="a JSON array; null clears")
    update_option(parser, "--write-policy", choices=POLICIES)
    verb("delete-memory", "delete a memory and its entries").add_argument("id")

    parser = verb("create-memory-entry", "write an entry through the dedup algorithm")
    parser.add_argument("--memory-id", required=True)
    parser.add_argument("--content", required=True)
    parser.add_argument("--tags", type=json_array, help="a JSON array of strings")
    parser.add_argument("--metadata", type=json_object, help="a JSON object")
    parser.add_argument("--duplicate-threshold", type=finite_number, help="0..1 (default 0.95)")
    parser.add_argument("--source-type", choices=[t.value for t in SourceType], help="default manual")
    parser.add_argument("--write-policy", choices=POLICIES, help="this write only; default: the memory's")
    parser.add_argument("--idempotency-key", help="a retry with the same key gets the first outcome")
    parser = verb("list-memory-entries", "list a memory's entries")
    parser.add_argument("--memory-id", required=True)
    parser.add_argument("--include-invalidated", action="store_true")
    _paging(parser)
    verb("get-memory-entry", "show an entry (also an invalidated one)").add_argument("id")
    parser = verb("update-memory-entry", "edit an entry: tags/metadata replaced, new content re-embedded")
    parser.add_argument("id")
    update_option(parser, "--content", type=kept_text)
    update_option(parser, "--tags", type=json_array, help="a JSON array; null clears")
    update_option(parser, "--metadata", type=json_object, help="a JSON object; null clears")
    verb("delete-memory-entry", "delete an entry").add_argument("id")
    verb("get-memory-write", "the outcome of a write that answered pending").add_argument("id")

    parser = verb("search", "search entries by similarity (with --query) or list them by filters")
    parser.add_argument("--query")
    parser.add_argument("--memory-ids", type=one_or_many, nargs="+", action=Values, metavar="ID")
    parser.add_argument("--memory-tags", type=one_or_many, nargs="+", action=Values, metavar="GLOB")
    parser.add_argument("--limit", type=int, help="default 10, at most 100")
    parser.add_argument("--min-score", type=finite_number)
    parser.add_argument("--project-id")

    parser = subparsers.add_parser(
        "import", help="import entries from JSON Lines; re-running imports nothing twice", parents=[common]
    )
    parser.add_argument("file", metavar="FILE.jsonl", help='lines of {"memory_id", "content", "tags"?, …}; - reads stdin')
    parser.add_argument("--concurrency", type=positive_int, default=4, help="memories written at once (default 4)")
    parser.set_defaults(func=run_import)
