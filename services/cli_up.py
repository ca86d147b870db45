"""`memories up`: the whole system on one machine (embedded PostgreSQL and NATS, migrations, the bus's layout, the
API, a writer and an extractor), supervised until Ctrl-C, then stopped in order."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from services.cli import _port
from shared.settings import Settings, get_settings

log = logging.getLogger("memories")

_SERVICES = ("api", "writer", "extractor")  # the API first: it is stopped before the others (_stop_services)


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    up = subparsers.add_parser(
        "up",
        help="embedded PostgreSQL + NATS, migrations, api, writer and extractor",
        description="Run the whole system on this machine: PostgreSQL with pgvector and NATS JetStream (unless "
        "DATABASE_URL / NATS_URL name servers to use), the migrations, then the API, the writer and the extractor, "
        "until Ctrl-C. Its data (the servers', the admin token) stays in the data directory for the next run.",
        epilog="Settings: MEMORIES_DATA_DIR (the data directory, .memories), MEMORIES_HOST and MEMORIES_PORT (the "
        "API's address, 127.0.0.1:8000), MEMORIES_ADMIN_TOKEN (else one generated into the data directory), "
        "DATABASE_URL, NATS_URL, MEMORIES_MERGE_MODEL; README.md lists them all.",
    )
    up.add_argument("--host", help="the API's address to listen on (default: MEMORIES_HOST, 127.0.0.1)")
    up.add_argument("--port", type=_port, help="the API's port (default: MEMORIES_PORT, 8000)")
    up.add_argument("--data-dir", type=Path, help="where the run keeps its data (default: MEMORIES_DATA_DIR, .memories)")
    up.set_defaults(func=cmd_up)


def _admin_token(settings: Settings) -> str:
    if settings.memories_admin_token:
        return settings.memories_admin_token
    path = settings.data_dir / "admin_token"
    if not path.exists():
        # Created readable by its owner only: written first and restricted after, it was readable by all meanwhile.
        with os.fdopen(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "w") as token_file:
            token_file.write(secrets.token_urlsafe(32))
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
    from shared.local_run import LOCAL_RUN_API_FILE, LOCAL_RUN_NATS_FILE
    from shared.servers import (
        EmbeddedNats,
        EmbeddedPostgres,
        LocalServersMissing,
        ServerStartError,
    )

    if args.data_dir is not None:  # as MEMORIES_DATA_DIR: the services and the one-shot commands read it there
        os.environ["MEMORIES_DATA_DIR"] = str(args.data_dir)
        get_settings.cache_clear()
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
    noted_api: Path | None = None
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
        reachable = _reachable(host)  # where a client on this machine finds the API, the probes, the metrics
        # For the CLI's verbs in another shell (`up --port` changes the address MEMORIES_PORT would give them).
        noted_api = settings.data_dir / LOCAL_RUN_API_FILE
        noted_api.write_text(f"http://{reachable}:{port}")
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
        _announce(env, settings, reachable, metrics_ports)
        probes = [f"http://{reachable}:{each}/readyz" for each in (port, *metrics_ports.values())]
        return _supervise(children, _until_ready(probes, f"http://{reachable}:{port}"))
    finally:
        _stop_services(children, api_grace_s=stop_grace_s(settings))
        if noted_nats is not None:  # only this run's: another `up` refused on the same data dir leaves it be
            noted_nats.unlink(missing_ok=True)
        if noted_api is not None:
            noted_api.unlink(missing_ok=True)
        for server in reversed(started):
            server.stop()
        if children:  # the last line: uvicorn's "Finished server process" was, and said nothing of the rest
            log.info("Memories stopped: the services%s", " and the servers it started" if started else "")


def _reachable(host: str) -> str:
    """The address a client on this machine reaches a server listening on `host` at."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


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


def _announce(env: dict[str, str], settings: Settings, reachable: str, metrics_ports: dict[str, int]) -> None:
    from shared.embeddings import LOCAL_PREFIX

    base = f"http://{reachable}:{env['MEMORIES_PORT']}"
    lines = [
        f"Memories is starting at {base}  (API under {base}/api/v1, docs at {base}/docs); it says when it is ready",
        f"Admin token: {env['MEMORIES_ADMIN_TOKEN']}",
        "Metrics: API " + f"{base}/metrics, "
        + ", ".join(f"{name} http://{reachable}:{port}/metrics" for name, port in metrics_ports.items()),
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
