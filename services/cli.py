"""`memories`: run the whole system on one machine, or one service, or an operator's task."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import sys
from collections.abc import Coroutine, Sequence
from typing import Any

from shared.lifecycle import limit_malloc_arenas
from shared.settings import Settings, get_settings

log = logging.getLogger("memories")


def _configure_logging() -> None:
    from pydantic import ValidationError

    from shared.logs import configure

    try:
        log_format = get_settings().memories_log_format
    except ValidationError:
        log_format = "auto"  # the command itself reports the invalid settings, in a readable log at least
    configure(log_format)


def _parse_partitions(spec: str | None, count: int | None = None) -> list[int] | None:
    """`0-7` or `0,3,5`: the partitions a writer replica binds to (default: all). With `count` (the deployment's
    MEMORIES_PARTITIONS), one that does not exist is refused: a stale range would look healthy and consume
    nothing. Raises ValueError."""
    if not spec:
        return None
    partitions: list[int] = []
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        high = high if dash else low
        if not low.isdigit() or not high.isdigit() or int(high) < int(low):
            raise ValueError(f"--partitions {spec!r}: expected ranges such as 0-7 or a list such as 0,3,5")
        partitions.extend(range(int(low), int(high) + 1))
    missing = sorted({p for p in partitions if count is not None and p >= count})
    if missing:
        raise ValueError(
            f"--partitions {spec!r}: partitions {missing} do not exist (MEMORIES_PARTITIONS is {count}: 0-{count - 1})"
        )
    return partitions


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end is closed (poll reports an error on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def run_service(main: Coroutine[Any, Any, int]) -> int:
    """A service's event loop: uvloop, as uvicorn picks for the API (less CPU per socket event); its exit status."""
    import uvloop

    from shared.settings import ConfiguredUnlike

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        try:
            return runner.run(main)
        except ConfiguredUnlike as exc:  # configured unlike the servers: what to change, not a traceback
            log.critical("%s", exc)
            return 1


async def _configured_alike(settings: Settings) -> int:
    """0 when the bus is laid out for this service's partition count and the stored vectors have its embedding
    dimension (or neither is made yet); raises ConfiguredUnlike otherwise. Waits for the schema this version needs."""
    from shared import bus, bus_connection
    from shared.db.migrate import wait_for_schema
    from shared.db.session import check_embedding_dimensions, create_engine

    nc = await bus_connection.connect(settings.nats_url or "", name="memories-api-check", settings=settings)
    try:
        await bus.check_partitions(nc.jetstream(), settings)
    finally:
        await nc.close()
    engine = create_engine(settings.database_url or "", pool_size=1, max_overflow=0)
    try:
        await wait_for_schema(engine)
        await check_embedding_dimensions(engine, settings.embedding_dimensions)
    finally:
        await engine.dispose()
    return 0


def _missing_servers(settings: Settings, command: str, *, bus: bool = True) -> bool:
    """A command run on its own needs its servers named (`memories up` starts its own); says so in one line."""
    named = [("DATABASE_URL", settings.database_url)] + ([("NATS_URL", settings.nats_url)] if bus else [])
    missing = [name for name, url in named if not url]
    if missing:
        print(f"memories {command}: {' and '.join(missing)} not set (or run `memories up`)", file=sys.stderr)
    return bool(missing)


def cmd_api(args: argparse.Namespace) -> int:
    import uvicorn

    from services.api.main import create_app
    from services.api.serving import server_config

    settings = get_settings()
    if _missing_servers(settings, "api"):
        return 2
    # uvicorn reports a failed start with the lifespan's traceback; servers configured otherwise are said in one line.
    if run_service(_configured_alike(settings)):
        return 1
    host, port = args.host or settings.memories_host, args.port or settings.memories_port
    server = uvicorn.Server(server_config(create_app(settings), settings, host=host, port=port, log_level="info"))
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn stops in order on Ctrl-C, then raises it again
        server.run()
    return 0 if server.started else 3  # uvicorn's own status for a failed start


def cmd_writer(args: argparse.Namespace) -> int:
    from services.writer.main import run

    settings = get_settings()
    try:
        partitions = _parse_partitions(args.partitions, settings.memories_partitions)
    except ValueError as exc:
        print(f"memories writer: {exc}", file=sys.stderr)
        return 2
    if _missing_servers(settings, "writer"):
        return 2
    return run_service(run(settings, partitions))


def cmd_extractor(_args: argparse.Namespace) -> int:
    from services.extractor.main import run

    settings = get_settings()
    if _missing_servers(settings, "extractor"):
        return 2
    return run_service(run(settings))


def cmd_migrate(_args: argparse.Namespace) -> int:
    from shared.db.migrate import upgrade

    settings = get_settings()
    if _missing_servers(settings, "migrate", bus=False):
        return 2
    assert settings.database_url
    upgrade(settings.database_url)
    return 0


BENCHMARKS = ("search", "write", "guard", "extract")

_COMMAND_MODULES = ("services.cli_bus", "services.cli_dlq", "services.cli_resources", "services.cli_contracts")
"""Modules whose `register(subparsers)` adds more verbs (the bus, dead letters, the REST resources, contracts)."""


def cmd_bench(args: argparse.Namespace) -> int:
    """Each benchmark is a module services.bench.<name> with `main(argv) -> int`; it prints a table."""
    module = importlib.import_module(f"services.bench.{args.benchmark}")
    return int(module.main(args.bench_args))


def _port(value: str) -> int:
    port = int(value) if value.isdigit() else 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is no TCP port (1 to 65535)")
    return port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memories", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    importlib.import_module("services.cli_up").register(sub)  # first in the help, as in the README
    api = sub.add_parser("api", help="run the REST API against DATABASE_URL and NATS_URL")
    api.add_argument("--host")
    api.add_argument("--port", type=_port)
    api.set_defaults(func=cmd_api)
    writer = sub.add_parser("writer", help="run one writer replica")
    writer.add_argument("--partitions", help="e.g. 0-7 or 0,3,5 (default: all)")
    writer.set_defaults(func=cmd_writer)
    sub.add_parser("extractor", help="run one extractor replica").set_defaults(func=cmd_extractor)
    sub.add_parser("migrate", help="apply the database migrations").set_defaults(func=cmd_migrate)
    bench = sub.add_parser("bench", help="benchmarks that print a table (not tests)")
    bench.add_argument("benchmark", choices=BENCHMARKS)
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="options of that benchmark (--help)")
    bench.set_defaults(func=cmd_bench)
    for module in _COMMAND_MODULES:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from pydantic import ValidationError

    from shared.events import problem_of

    limit_malloc_arenas()
    _configure_logging()
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's, say: a real error
        # The reader of the output went away (`memories dlq list | head`): what it wanted it has; no traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a shell reports a command killed by SIGPIPE
    except ValidationError as exc:
        if exc.title != Settings.__name__:
            raise
        # A setting from the environment that does not validate: say which, as a usage error, not a traceback.
        for error in exc.errors():
            name = str(error["loc"][0]).upper() if error["loc"] else "?"
            print(f"invalid setting {name}: {problem_of(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

