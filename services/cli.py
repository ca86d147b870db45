"""`memories`: run the whole system on one machine, or one service, or an operator's task."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from shared.embeddings import LOCAL_PREFIX
from shared.lifecycle import limit_malloc_arenas
from shared.settings import Settings, get_settings

log = logging.getLogger("memories")

_SERVICES = ("api", "writer", "extractor")  # the API first: it is stopped before the others (_stop_services)


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


def _admin_token(settings: Settings) -> str:
    if settings.memories_admin_token:
        return settings.memories_admin_token
    path = settings.data_dir / "admin_token"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(32))
        path.chmod(0o600)
    return path.read_text().strip()


def _ports_taken(host: str, api_port: int, metrics_ports: dict[str, int]) -> str | None:
    """Why the local run's ports cannot be used, before anything starts (the API found its port taken only after
    the servers, the migrations and the model: ~7 s, and the writer's metrics port with a 40-line traceback)."""
    wanted = {"the API (MEMORIES_PORT)": api_port} | {f"the {name}'s metrics": port for name, port in metrics_ports.items()}
    if len(set(wanted.values())) < len(wanted):
        return (f"two services would listen on one port ({', '.join(f'{who} {port}' for who, port in wanted.items())}):"
                " the writer's metrics go on MEMORIES_METRICS_PORT, the extractor's on the next port")
    for who, port in wanted.items():
        if not 1 <= port <= 65535:
            return f"port {port} for {who} is no TCP port (1 to 65535)"
        try:
            family, kind, protocol, _name, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind(address)
        except OSError as exc:  # taken, or an address not of this host (socket.gaierror is one)
            return f"port {port} for {who} on {host} cannot be used: {exc.strerror or exc}"
    return None


def cmd_up(args: argparse.Namespace) -> int:
    from services.api.serving import stop_grace_s
    from services.cli_bus import lay_out_for_the_local_run
    from shared.db.migrate import upgrade
    from shared.servers import (
        LOCAL_RUN_NATS_FILE,
        EmbeddedNats,
        EmbeddedPostgres,
        LocalServersMissing,
        ServerStartError,
    )

    settings = get_settings()
    host, port = args.host or settings.memories_host, args.port or settings.memories_port
    metrics_ports = _metrics_ports(settings)
    if refused := _ports_taken(host, port, metrics_ports):
        print(f"memories up: {refused}", file=sys.stderr)
        return 1
    try:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there, a read-only mount
        print(f"memories up: the data directory {settings.data_dir} cannot be used: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    started: list[EmbeddedPostgres | EmbeddedNats] = []
    env = dict(os.environ)
    children: list[subprocess.Popen[bytes]] = []
    noted_nats: Path | None = None
    try:
        try:
            if not settings.database_url:
                postgres = EmbeddedPostgres(settings.data_dir / "postgres")
                env["DATABASE_URL"] = postgres.start()
                started.append(postgres)
                log.info("embedded PostgreSQL at %s", env["DATABASE_URL"])
            if not settings.nats_url:
                nats_server = EmbeddedNats(settings.data_dir / "nats")
                env["NATS_URL"] = nats_server.start()
                started.append(nats_server)
                log.info("embedded NATS at %s", env["NATS_URL"])
        except (ServerStartError, LocalServersMissing, OSError) as exc:  # another `up` on this data dir, …
            print(f"memories up: {exc}", file=sys.stderr)
            return 1
        if not settings.nats_url:
            # For the one-shot commands (`dlq`, `bus init`); a NATS_URL given to `up` is the operator's to share.
            noted_nats = settings.data_dir / LOCAL_RUN_NATS_FILE
            noted_nats.write_text(env["NATS_URL"])
            refused = lay_out_for_the_local_run(env["NATS_URL"], settings)
            if refused:
                print(f"memories up: {refused}", file=sys.stderr)
                return 1
        env["MEMORIES_ADMIN_TOKEN"] = _admin_token(settings)
        env["MEMORIES_HOST"] = host
        env["MEMORIES_PORT"] = str(port)
        upgrade(env["DATABASE_URL"])
        for service in _SERVICES:
            # On the API's address (local unless --host says otherwise): /metrics and the probes need no token.
            child_env = {**env, "MEMORIES_METRICS_PORT": str(metrics_ports.get(service, 0)),
                         "MEMORIES_METRICS_HOST": env["MEMORIES_HOST"]}
            command = [sys.executable, "-m", "services.cli", service]
            # `up` runs no thread of its own that the fork could catch holding a lock.
            ends = _ends_with(os.getpid())
            # No terminal input: in a process group of its own, a read from the terminal would stop it (SIGTTIN).
            children.append(subprocess.Popen(command, env=child_env, stdin=subprocess.DEVNULL, preexec_fn=ends))  # noqa: PLW1509
        _announce(env, settings, metrics_ports)
        probes = [f"http://{env['MEMORIES_HOST']}:{port}/readyz" for port in (env["MEMORIES_PORT"], *metrics_ports.values())]
        return _supervise(children, _until_ready(probes, f"http://{env['MEMORIES_HOST']}:{env['MEMORIES_PORT']}"))
    finally:
        _stop_services(children, api_grace_s=stop_grace_s(settings))
        if noted_nats is not None:  # only this run's: another `up` refused on the same data dir leaves it be
            noted_nats.unlink(missing_ok=True)
        for server in reversed(started):
            server.stop()


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end is closed (poll reports an error on it)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):
        return False


def _ends_with(parent: int) -> Callable[[], None]:
    """For a child of `up`, run before its exec. Its own process group: a terminal's Ctrl-C reaches `up` alone,
    which stops the services in order (_stop_services). And SIGTERM when `up` dies, even by SIGKILL (Linux's
    parent-death signal), so that no service outlives it holding the port (the servers it started are stopped by
    the next `up`, through their pid files)."""
    if not sys.platform.startswith("linux"):
        return os.setpgrp

    import ctypes

    prctl = ctypes.CDLL(None).prctl  # resolved here: between fork and exec the child only calls it
    pr_set_pdeathsig = 1

    def ask_for_sigterm() -> None:
        os.setpgrp()
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # `up` died before the request took effect
            os._exit(0)

    return ask_for_sigterm


def _stop_services(children: Sequence[subprocess.Popen[bytes]], *, api_grace_s: float) -> None:
    """The API first (children[0]), the others once it is gone: its writes in flight are still decided by a
    running writer and answered, where stopping every service at once left them waiting out their timeout for a
    202, or cut off by the kill. Each is killed if it outlasts its grace: the API's covers a write's timeout."""
    def force(_signum: int, _frame: object) -> None:  # the services no longer hear the terminal: `up` passes it on
        for child in children:
            if child.poll() is None:
                child.kill()

    if any(child.poll() is None for child in children):
        log.info("stopping the API (up to %g s), then the writer and the extractor; Ctrl-C again to force", api_grace_s)
    previous = {signum: signal.signal(signum, force) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        api, others = children[:1], children[1:]
        for group, grace_s in ((api, api_grace_s), (others, 15.0)):
            for child in group:
                if child.poll() is None:
                    child.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("service %s did not stop within %g s; killing it", child.args, grace_s)
                    child.kill()
                    child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _metrics_ports(settings: Settings) -> dict[str, int]:
    """One process, one port: the writer and the extractor each serve /metrics on their own."""
    from shared.servers import free_port

    if settings.memories_metrics_port:
        return {"writer": settings.memories_metrics_port, "extractor": settings.memories_metrics_port + 1}
    return {"writer": free_port(), "extractor": free_port()}


def _announce(env: dict[str, str], settings: Settings, metrics_ports: dict[str, int]) -> None:
    base = f"http://{env['MEMORIES_HOST']}:{env['MEMORIES_PORT']}"
    lines = [
        f"Memories is starting at {base}  (API under {base}/api/v1, docs at {base}/docs); it says when it is ready",
        f"Admin token: {env['MEMORIES_ADMIN_TOKEN']}",
        "Metrics: API " + f"{base}/metrics, "
        + ", ".join(f"{name} http://{env['MEMORIES_HOST']}:{port}/metrics" for name, port in metrics_ports.items()),
        f"Embeddings: {settings.embedding_model}"
        + (" (in-process, offline)" if settings.embedding_model.startswith(LOCAL_PREFIX) else ""),
    ]
    lines.append(_models_line(settings))
    print("\n".join(lines), flush=True)


def _models_line(settings: Settings) -> str:
    """What the run can ask a model for, and what it falls back to where it cannot."""
    if settings.memories_merge_model:
        return (
            "Service model (MEMORIES_MERGE_MODEL), for merges and extraction that name none: "
            f"{settings.memories_merge_model}"
        )
    if settings.agent_model_providers:
        return (
            "No MEMORIES_MERGE_MODEL: writes without a model of their own (REST writes to `arbitrate` memories) use "
            "the `guarded` rule; agents' models of " + ", ".join(sorted(settings.agent_model_providers))
            + " and projects' AI providers and model routes are asked for merges and extraction."
        )
    return (
        "No LLM is configured here (none can be installed offline): agent merges fall back to create, "
        "`arbitrate` memories to the `guarded` rule, and "
        "automatic extraction is off until a model is named - a project's AI provider or model route "
        "(/api/v1/ai-providers, /api/v1/model-routes), MEMORIES_MERGE_MODEL, or an agent's `model` of a "
        "provider in MEMORIES_AGENT_MODEL_PROVIDERS."
    )


def _until_ready(probes: Sequence[str], base: str) -> Callable[[], bool]:
    """A check `up` makes while it waits: True once every service's `/readyz` has answered 200, when it says so (the
    API answers before the writer has loaded its model: a write sent meanwhile may wait out its timeout, a 202)."""
    import http.client
    import urllib.request

    waiting = list(probes)
    local = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through an HTTP_PROXY

    def check() -> bool:
        while waiting:
            try:
                local.open(waiting[0], timeout=0.5).close()
            except (OSError, http.client.HTTPException):  # refused, not ready yet (an HTTPError), a broken answer
                return False
            waiting.pop(0)
            if not waiting:
                print(f"Memories is ready at {base}: the API, the writer and the extractor are up", flush=True)
        return True

    return check


def _supervise(children: Sequence[subprocess.Popen[bytes]], ready: Callable[[], bool]) -> int:
    """Until a stop is asked for or a service exits (its exit code), calling `ready` until it is True."""
    stop = False
    is_ready = False

    def request_stop(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGHUP, request_stop)  # the terminal closed: its signal no longer reaches the services
    while not stop:
        for child in children:
            if child.poll() is not None:
                status = child.returncode
                if status < 0:  # killed by a signal: said as a shell says it (128 + the signal), not -9 read as 247
                    log.error("service %s was killed by signal %s; stopping everything", child.args, -status)
                    return 128 - status
                log.error("service %s exited with %s; stopping everything", child.args, status)
                return status or 1
        is_ready = is_ready or ready()
        time.sleep(0.2)
    return 0


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
    dimension (or neither is made yet); raises ConfiguredUnlike otherwise."""
    from shared import bus, bus_connection
    from shared.db.session import check_embedding_dimensions, create_engine

    nc = await bus_connection.connect(settings.nats_url or "", name="memories-api-check", settings=settings)
    try:
        await bus.check_partitions(nc.jetstream(), settings)
    finally:
        await nc.close()
    engine = create_engine(settings.database_url or "", pool_size=1, max_overflow=0)
    try:
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
    up = sub.add_parser("up", help="embedded PostgreSQL + NATS, migrations, api, writer and extractor")
    up.add_argument("--host")
    up.add_argument("--port", type=_port)
    up.set_defaults(func=cmd_up)
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

