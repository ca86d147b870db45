"""A whole system in a temp dir for the fault tests: its own PostgreSQL, NATS (one node or a cluster), `memories
api` and `memories writer` subprocesses, a load client that retries as a well-behaved client does (same
Idempotency-Key, backing off on 503 and 202), and the exactly-once checks over the resulting tables.

Every wait is bounded; `System.close()` kills whatever is still running.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
from sqlalchemy import func, select

from shared import bus
from shared.db.migrate import upgrade
from shared.db.models import EntryHistory, MemoryEntry, WriteOutcome
from shared.db.session import create_engine, session_factory
from shared.servers import EmbeddedNats, EmbeddedPostgres, free_port, start_nats_cluster

ADMIN_TOKEN = "fault-tests-admin-token"
WRITER_READY_LINE = b"writer consuming partitions"

_SUBJECTS = ["The customer", "Our supplier", "The night shift", "The auditor", "The mobile team", "Our landlord"]
_VERBS = ["prefers", "asked for", "rejected", "pays extra for", "reported problems with", "scheduled"]
_OBJECTS = ["express shipping", "paper invoices", "a quarterly review", "vegan catering", "the blue pallets",
            "weekend deliveries", "Portuguese manuals", "a new VPN", "cold storage", "the loading dock"]


class System:
    """PostgreSQL + NATS + processes of one fault test. Servers keep their ports across restarts."""

    def __init__(self, root: Path, *, nats_nodes: int = 1, partitions: int = 8, **env: str) -> None:
        self.root = root
        self.postgres = EmbeddedPostgres(root / "postgres")
        self.nats: list[EmbeddedNats] = []
        self._nats_nodes = nats_nodes
        self._partitions = partitions
        self._extra_env = env
        self.env: dict[str, str] = {}
        self.api_port = free_port()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def nats_url(self) -> str:
        return self.env["NATS_URL"]

    def start_servers(self) -> None:
        database_url = self.postgres.start()
        upgrade(database_url)
        if self._nats_nodes == 1:
            self.nats = [EmbeddedNats(self.root / "nats")]
            self.nats[0].start()
        else:
            self.nats = start_nats_cluster(self.root / "nats", self._nats_nodes)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith(("MEMORIES_", "DATABASE_URL", "NATS_URL"))},
            "DATABASE_URL": database_url,
            "NATS_URL": ",".join(node.url for node in self.nats),
            "MEMORIES_DATA_DIR": str(self.root / "data"),
            "MEMORIES_ADMIN_TOKEN": ADMIN_TOKEN,
            "MEMORIES_PARTITIONS": str(self._partitions),
            "MEMORIES_STREAM_REPLICAS": str(self._nats_nodes),
            # Short enough that a write held by a killed writer comes back within seconds.
            "MEMORIES_ACK_WAIT_S": "3",
            # High enough that no outage of these tests dead-letters a write (checked at the end).
            "MEMORIES_MAX_DELIVER": "100",
            "MEMORIES_RETRY_BACKOFF_S": "0.1",
            "MEMORIES_WRITE_TIMEOUT_S": "5",
            **self._extra_env,
        }
        self.init_bus()

    def init_bus(self, timeout: float = 60) -> None:
        """`memories bus init`, once before the services, as the deployments run it: on a cluster, services
        that all create the replicated streams at once can time out (the API then fails to start)."""
        done = subprocess.run([sys.executable, "-m", "services.cli", "bus", "init"], env=self.env, cwd=self.root,
                              capture_output=True, text=True, timeout=timeout, check=False)
        assert done.returncode == 0, done.stdout + done.stderr

    def _spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{name}.log", "ab") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.cli", *args], env=self.env, cwd=self.root,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs[name] = proc
        return proc

    def log_tail(self, name: str, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return b"\n".join((self.root / f"{name}.log").read_bytes().splitlines()[-lines:]).decode(errors="replace")
        return ""

    async def start_writer(self, name: str = "writer", timeout: float = 60) -> None:
        log_path = self.root / f"{name}.log"
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = self._spawn(name, "writer")
        deadline = time.monotonic() + timeout
        while WRITER_READY_LINE not in log_path.read_bytes()[offset:]:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} did not start ({proc.poll()}):\n{self.log_tail(name)}")
            await asyncio.sleep(0.1)

    async def start_api(self, timeout: float = 60) -> None:
        proc = self._spawn("api", "api", "--port", str(self.api_port))
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(base_url=self.api_url, timeout=2) as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get("/readyz")).status_code == 200:
                        return
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"api did not start:\n{self.log_tail('api')}")
                await asyncio.sleep(0.1)

    async def ensure_running(self, writers: list[str]) -> None:
        """Restart whatever an earlier test of a shared system left dead, so tests do not cascade."""
        for node in self.nats:
            if node.pid is None:
                await asyncio.to_thread(node.start)
        if self.postgres.pid is None:
            await asyncio.to_thread(self.postgres.start)
        missing = [name for name in writers if name not in self.procs or self.procs[name].poll() is not None]
        starts = [self.start_writer(name) for name in missing]
        if "api" not in self.procs or self.procs["api"].poll() is not None:
            starts.append(self.start_api())
        await asyncio.gather(*starts)

    async def freeze(self, name: str, seconds: float) -> None:
        """SIGSTOP then SIGCONT: a process that stalls (a long GC pause, a frozen VM) beyond the ack wait."""
        pid = self.procs[name].pid
        os.killpg(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(seconds)
        finally:
            os.killpg(pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        """SIGKILL, like a crash (or the OOM killer): no shutdown hook runs."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)

    def close(self) -> None:
        for name in list(self.procs):
            self.kill(name)
        for node in self.nats:
            node.kill()
        self.postgres.kill()


@contextlib.contextmanager
def running_system(**kwargs: Any) -> Iterator[System]:
    # Not pytest's tmp_path: a pytest run that starts meanwhile resets /tmp/pytest-of-<user> to 0700, and the
    # PostgreSQL server, which runs as another user when we are root, then loses its data directory.
    root = Path(tempfile.mkdtemp(prefix="memories-faults-"))
    system = System(root, **kwargs)
    try:
        system.start_servers()
        yield system
    finally:
        system.close()
        shutil.rmtree(root, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class Write:
    key: str
    memory_id: str
    content: str


def plan_writes(memory_ids: list[str], per_memory: int, repeats: int, seed: int = 7) -> list[Write]:
    """`per_memory` writes to each memory, `repeats` of them exact copies of its other facts, shuffled.

    Distinct facts differ in their numbers and words, and the writes carry duplicate_threshold 1.0, so the
    final table does not depend on the order the writes were decided in: a calm run keeps every distinct
    fact once and skips every copy, whatever the interleaving.
    """
    rng = random.Random(seed)
    writes: list[Write] = []
    for m, memory_id in enumerate(memory_ids):
        facts = [
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} on order {m * 1000 + i}"
            for i in range(per_memory - repeats)
        ]
        contents = facts + [rng.choice(facts) for _ in range(repeats)]
        writes += [Write(f"fault-{m}-{i}", memory_id, content) for i, content in enumerate(contents)]
    rng.shuffle(writes)
    return writes


@dataclass
class Load:
    """What the clients saw. `timeline` holds (monotonic time of the response, status)."""

    statuses: Counter[int] = field(default_factory=Counter)
    timeline: list[tuple[float, int]] = field(default_factory=list)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    transport_errors: list[str] = field(default_factory=list)  # each one's type, message and moment, to tell them apart
    unexpected: list[str] = field(default_factory=list)
    samples: dict[int, dict[str, Any]] = field(default_factory=dict)  # the first body of each status

    def longest_stall(self) -> float:
        """The longest time without a decided write answered: what a fault cost the clients."""
        decided = sorted(at for at, status in self.timeline if status in (200, 201))
        return max((b - a for a, b in itertools.pairwise(decided)), default=0.0)

    def statuses_between(self, start: float, end: float) -> Counter[int]:
        return Counter(status for at, status in self.timeline if start <= at <= end)

    async def wait_for(self, done: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.results) < done:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(self.results)} of {done} writes done after {timeout}s")
            await asyncio.sleep(0.05)


def admin_client(system: System) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"{system.api_url}/api/v1", timeout=30,
                             headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})


async def create_memories(system: System, count: int) -> tuple[str, list[str]]:
    async with admin_client(system) as client:
        project = (await client.post("/projects", json={"name": "faults"})).json()
        memory_ids = []
        for i in range(count):
            response = await client.post("/memories", json={"project_id": project["id"], "name": f"memory {i}"})
            assert response.status_code == 201, response.text
            memory_ids.append(response.json()["id"])
    return project["id"], memory_ids


async def drive(system: System, writes: list[Write], load: Load, *, concurrency: int = 16,
                deadline_s: float = 150) -> None:
    """Send every write until it has its decision (200/201), `concurrency` at a time, retrying 503, 202 and
    dropped connections with the same Idempotency-Key. Any other status is recorded as unexpected."""
    deadline = time.monotonic() + deadline_s
    queue: asyncio.Queue[Write] = asyncio.Queue()
    for write in writes:
        queue.put_nowait(write)

    async def send(client: httpx.AsyncClient, write: Write) -> None:
        body = {"memory_id": write.memory_id, "content": write.content, "duplicate_threshold": 1.0}
        while time.monotonic() < deadline:
            try:
                response = await client.post("/memory-entries", json=body, headers={"Idempotency-Key": write.key})
            except httpx.TransportError as error:
                load.transport_errors.append(f"{type(error).__name__} at {time.monotonic():.1f}: {error!r}")
                await asyncio.sleep(0.3)
                continue
            load.statuses[response.status_code] += 1
            load.timeline.append((time.monotonic(), response.status_code))
            if response.status_code not in load.samples:
                try:
                    load.samples[response.status_code] = response.json()
                except ValueError:
                    load.samples[response.status_code] = {"text": response.text[:300]}
            if response.status_code in (200, 201):
                load.results[write.key] = response.json()
                return
            if response.status_code not in (202, 503):
                load.unexpected.append(f"{response.status_code} {response.text[:300]}")
            # A 202's retry waits for the stored outcome; a 503's retry may claim the write again.
            await asyncio.sleep(0.2 if response.status_code == 202 else 0.3)
        raise AssertionError(f"write {write.key} not decided within {deadline_s}s")

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            await send(client, queue.get_nowait())

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=f"{system.api_url}/api/v1", timeout=30, limits=limits,
                                 headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))


async def assert_applied_exactly_once(system: System, project_id: str, writes: list[Write], load: Load) -> None:
    """The calm run's table, one decision and one history record per write, nothing parked or queued."""
    assert not load.unexpected, load.unexpected[:5]
    assert load.statuses[500] == 0
    assert not load.transport_errors, f"the API dropped connections (an error after the response started?): {load.transport_errors}"
    assert set(load.results) == {w.key for w in writes}
    distinct = {(w.memory_id, w.content) for w in writes}
    actions = Counter(result["action"] for result in load.results.values())
    assert actions == {"created": len(distinct), "skipped": len(writes) - len(distinct)}, actions
    entry_of: dict[tuple[str, str], set[str]] = {}
    for write in writes:
        entry_of.setdefault((write.memory_id, write.content), set()).add(load.results[write.key]["id"])
    assert all(len(ids) == 1 for ids in entry_of.values()), "copies of one fact answered with different entries"

    engine = create_engine(system.env["DATABASE_URL"], pool_size=1)
    try:
        async with session_factory(engine)() as session:
            rows = (await session.execute(
                select(MemoryEntry.memory_id, MemoryEntry.content)
                .where(MemoryEntry.project_id == project_id, MemoryEntry.invalidated_at.is_(None))
            )).all()
            assert Counter((r.memory_id, r.content) for r in rows) == Counter(distinct)
            outcomes = Counter((await session.scalars(
                select(WriteOutcome.status).where(WriteOutcome.project_id == project_id)
            )).all())
            assert outcomes == {"applied": len(writes)}, outcomes
            per_write = (await session.execute(
                select(EntryHistory.write_id, func.count())
                .where(EntryHistory.project_id == project_id)
                .group_by(EntryHistory.write_id)
            )).all()
            written_ids = {result["write_id"] for result in load.results.values()}
            assert {write_id for write_id, _ in per_write} == written_ids
            assert max(count for _, count in per_write) == 1, "a write had more than one effect"
    finally:
        await engine.dispose()
    await assert_streams_drained(system)


async def assert_streams_drained(system: System, timeout: float = 15) -> None:
    """No write left queued in MEMORY_WRITES (acks may trail the replies briefly) and none dead-lettered."""
    nc = await nats.connect(system.nats_url.split(","), connect_timeout=5)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while (queued := (await js.stream_info(bus.WRITES_STREAM)).state.messages) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert queued == 0, f"{queued} writes still in {bus.WRITES_STREAM}"
        assert (await js.stream_info(bus.DEAD_LETTER_STREAM)).state.messages == 0
    finally:
        await nc.close()
