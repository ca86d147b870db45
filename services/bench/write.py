"""`memories bench write`: drive the REST write path with concurrent clients and print a table.

Runs the real system: PostgreSQL and NATS (embedded, or DATABASE_URL / NATS_URL), the API and one writer as
separate processes, the load from this process. Scenarios, in order: distinct facts spread over many
memories (created), the same facts again (exact copies: skipped without embedding), near-copies (embedded,
then skipped), and many clients writing distinct facts into one memory. The raw embedder's batched
throughput on the same texts is measured in this run, for the ratio the write path is judged by.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from services.bench._cpu import snapshot
from services.bench._system import bench_environment
from shared.embeddings import embed_texts
from shared.servers import free_port
from shared.settings import get_settings

TOKEN = "bench-admin-token"
_VOCAB = Path(__file__).resolve().parents[2] / "shared" / "embeddings" / "data" / "tokenizer.json"


def vocabulary() -> list[str]:
    words = json.loads(_VOCAB.read_text())["model"]["vocab"]
    return sorted(w for w in words if w.isalpha() and w.islower() and 4 <= len(w) <= 10)


def facts(count: int, seed: int) -> list[str]:
    """Distinct sentences of random words: far apart for the embedder, so each is a new fact."""
    rng = random.Random(seed)
    words = vocabulary()
    return [f"The {rng.choice(words)} {' '.join(rng.choice(words) for _ in range(7))} number {i}" for i in range(count)]


def near_copy(text: str) -> str:
    return text.replace("The ", "Note that the ", 1)


@dataclass
class Run:
    name: str
    latencies: list[float]
    seconds: float
    actions: Counter[str]
    cpu: dict[str, float]  # CPU seconds spent during the run, by process

    def row(self, processes: list[str]) -> str:
        lat = sorted(self.latencies)
        pct = lambda q: 1000 * lat[min(len(lat) - 1, int(q * len(lat)))]
        rate = len(lat) / self.seconds
        actions = ", ".join(f"{k} {v}" for k, v in sorted(self.actions.items()))
        per_write = " / ".join(f"{1000 * self.cpu.get(name, 0.0) / len(lat):.1f}" for name in processes)
        return (f"| {self.name} | {len(lat)} | {rate:,.0f} | {1000 * statistics.median(lat):.1f} | {pct(0.95):.1f} "
                f"| {pct(0.99):.1f} | {per_write} | {actions} |")


class RawConnection:
    """A keep-alive HTTP/1.1 connection that costs next to no CPU: the load generator shares the two cores
    with the system under test, and an HTTP client library spends more per request than the API does."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self._host, self._port, self._token = host, port, token
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        if self._writer is None:
            self._reader, self._writer = await asyncio.open_connection(self._host, self._port)
        assert self._reader is not None
        head = (f"POST {path} HTTP/1.1\r\nHost: {self._host}\r\nAuthorization: Bearer {self._token}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        self._writer.write(head.encode() + body)
        status_line = await self._reader.readline()
        length = 0
        while (line := await self._reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return int(status_line.split()[1]), await self._reader.readexactly(length)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


async def drive(
    base: str, name: str, writes: list[tuple[str, str]], clients: int, pids: dict[str, int], token: str
) -> Run:
    host, port = base.removeprefix("http://").split(":")
    queue: asyncio.Queue[bytes] = asyncio.Queue()
    for memory_id, content in writes:
        queue.put_nowait(json.dumps({"memory_id": memory_id, "content": content}).encode())
    latencies: list[float] = []
    actions: Counter[str] = Counter()

    async def worker() -> None:
        connection = RawConnection(host, int(port), token)
        try:
            while not queue.empty():
                body = queue.get_nowait()
                started = time.perf_counter()
                status, answer = await connection.post("/api/v1/memory-entries", body)
                latencies.append(time.perf_counter() - started)
                actions[json.loads(answer).get("action") or str(status)] += 1
        finally:
            connection.close()

    cpu_before, load_before = snapshot(pids), time.process_time()
    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    seconds = time.perf_counter() - started
    cpu = {name: used - cpu_before[name] for name, used in snapshot(pids).items()}
    cpu["load"] = time.process_time() - load_before
    return Run(name, latencies, seconds, actions, cpu)


async def scenarios(base: str, args: argparse.Namespace, pids: dict[str, int]) -> list[Run]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=f"{base}/api/v1", headers=headers, timeout=60) as client:
        project = (await client.post("/projects", json={"name": "bench"})).json()["id"]
        memories = [
            (await client.post("/memories", json={"project_id": project, "name": f"m{i}"})).json()["id"]
            for i in range(args.memories)
        ]
        hammered = (await client.post("/memories", json={"project_id": project, "name": "one"})).json()["id"]
        token = TOKEN
        if args.api_key:  # what a client holds: a project key (each API process remembers it briefly)
            body = {"project_id": project, "name": "bench", "actions": ["memories:CreateMemoryEntry"]}
            token = (await client.post("/api-keys", json=body)).json()["key"]
        texts = facts(args.writes, seed=1)
        spread = [(memories[i % len(memories)], text) for i, text in enumerate(texts)]
    async def run(name: str, writes: list[tuple[str, str]], clients: int = args.clients) -> Run:
        return await drive(base, name, writes, clients, pids, token)

    await run("warm-up", [(memories[0], "warm up the writer and the API")] * 4, clients=4)
    runs = [await run("created, many memories", spread)]
    runs.append(await run("exact copies", spread))
    runs.append(await run("near-copies", [(m, near_copy(t)) for m, t in spread]))
    one = [(hammered, text) for text in facts(args.writes // 2, seed=2)]
    runs.append(await run(f"{args.one_memory_clients} clients, one memory", one, args.one_memory_clients))
    return runs


async def raw_embedder(texts: list[str], batch: int) -> tuple[float, float]:
    """Texts a second, and CPU ms a text (every thread of this process: the model runs on all the cores)."""
    model = get_settings().embedding_model
    await embed_texts(texts[:batch], model=model)
    started, cpu_before = time.perf_counter(), time.process_time()
    for i in range(0, len(texts), batch):
        await embed_texts(texts[i : i + batch], model=model)
    cpu_ms = 1000 * (time.process_time() - cpu_before) / len(texts)
    return len(texts) / (time.perf_counter() - started), cpu_ms


def ceiling(created: Run, embedding_cpu_ms: float, cores: int) -> float:
    """The most created writes a second the cores could give if the writer's own work cost nothing and its
    embeddings cost what the raw batched embedder's do: every core busy with the embedding and the CPU that the
    API, PostgreSQL and NATS spent per created write in this run."""
    others_ms = sum(1000 * created.cpu.get(name, 0.0) for name in ("api", "postgres", "nats")) / len(created.latencies)
    return cores * 1000 / (embedding_cpu_ms + others_ms)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memories bench write", description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--writes", type=int, default=2000, help="writes per scenario")
    parser.add_argument("--memories", type=int, default=200)
    parser.add_argument("--one-memory-clients", type=int, default=50)
    parser.add_argument("--writers", type=int, default=1, help="writer processes (replicas)")
    parser.add_argument("--api-key", action="store_true",
                        help="write with a project API key, as clients do, instead of the admin token")
    args = parser.parse_args(argv)

    settings = get_settings()
    children: list[subprocess.Popen[bytes]] = []
    pids: dict[str, int] = {}
    with bench_environment(pids, MEMORIES_ADMIN_TOKEN=TOKEN) as env:
        try:
            port = free_port()
            log_dir = Path(os.environ.get("MEMORIES_BENCH_LOGS", os.devnull))
            for command in [["writer"]] * args.writers + [["api", "--port", str(port)]]:
                log = open(log_dir / f"{command[0]}.log", "a") if log_dir.is_dir() else subprocess.DEVNULL  # noqa: SIM115
                children.append(subprocess.Popen([sys.executable, "-m", "services.cli", *command], env=env,
                                                 stdout=subprocess.DEVNULL, stderr=log))
                pids[f"{command[0]}{len(children)}" if command[0] == "writer" else command[0]] = children[-1].pid
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            time.sleep(5)  # the writer loads its model in its own time
            runs = asyncio.run(scenarios(base, args, pids))
        finally:
            for child in children:
                child.terminate()
            for child in children:
                try:
                    child.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    child.kill()
    embed_rate, embed_cpu_ms = asyncio.run(raw_embedder(facts(args.writes, seed=1), batch=64))
    cores = len(os.sched_getaffinity(0))

    print(f"{args.clients} clients, {args.writes} writes per scenario over {args.memories} memories, "
          f"{args.writers} writer process(es), 1 API process, {'a project API key' if args.api_key else 'the admin token'}; "
          f"embedder {settings.embedding_model}; {cores} cores\n")
    processes = [name for name in pids if name.startswith("writer")] + ["api", "postgres", "nats", "load"]
    processes = [name for name in processes if name in runs[0].cpu]
    print("| scenario | writes | writes/s | p50 ms | p95 ms | p99 ms "
          f"| CPU ms per write: {' / '.join(processes)} | actions |")
    print("|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(run.row(processes))
    created = len(runs[0].latencies) / runs[0].seconds
    print(f"| raw embedder, batches of 64 | {args.writes} | {embed_rate:,.0f} | | | | {embed_cpu_ms:.1f} a text | |")
    print(f"\nmany-memory writes / raw batched embedder = {created / embed_rate:.0%} (target ≥ 70 %)")
    most = ceiling(runs[0], embed_cpu_ms, cores)
    print(f"ceiling on {cores} cores from this run's costs (embedding as in batches of 64, plus the API, PostgreSQL "
          f"and NATS per created write, the writer's own work free): {most:,.0f} writes/s = {most / embed_rate:.0%} "
          "of the raw embedder")
    return 0
