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
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from shared.db.migrate import upgrade
from shared.embeddings import embed_texts
from shared.servers import EmbeddedNats, EmbeddedPostgres, free_port
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

    def row(self) -> str:
        lat = sorted(self.latencies)
        pct = lambda q: 1000 * lat[min(len(lat) - 1, int(q * len(lat)))]  # noqa: E731
        rate = len(lat) / self.seconds
        actions = ", ".join(f"{k} {v}" for k, v in sorted(self.actions.items()))
        return (f"| {self.name} | {len(lat)} | {rate:,.0f} | {1000 * statistics.median(lat):.1f} | {pct(0.95):.1f} "
                f"| {pct(0.99):.1f} | {actions} |")


async def drive(client: httpx.AsyncClient, name: str, writes: list[tuple[str, str]], clients: int) -> Run:
    queue: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    for write in writes:
        queue.put_nowait(write)
    latencies: list[float] = []
    actions: Counter[str] = Counter()

    async def worker() -> None:
        while not queue.empty():
            memory_id, content = queue.get_nowait()
            started = time.perf_counter()
            response = await client.post("/memory-entries", json={"memory_id": memory_id, "content": content})
            latencies.append(time.perf_counter() - started)
            actions[response.json().get("action") or str(response.status_code)] += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return Run(name, latencies, time.perf_counter() - started, actions)


async def scenarios(base_url: str, args: argparse.Namespace) -> list[Run]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    limits = httpx.Limits(max_connections=args.clients)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60, limits=limits) as client:
        project = (await client.post("/projects", json={"name": "bench"})).json()["id"]
        memories = [
            (await client.post("/memories", json={"project_id": project, "name": f"m{i}"})).json()["id"]
            for i in range(args.memories)
        ]
        hammered = (await client.post("/memories", json={"project_id": project, "name": "one"})).json()["id"]
        texts = facts(args.writes, seed=1)
        spread = [(memories[i % len(memories)], text) for i, text in enumerate(texts)]
        await drive(client, "warm-up", [(memories[0], "warm up the writer and the API")] * 4, 4)
        runs = [await drive(client, "created, many memories", spread, args.clients)]
        runs.append(await drive(client, "exact copies", spread, args.clients))
        runs.append(await drive(client, "near-copies", [(m, near_copy(t)) for m, t in spread], args.clients))
        one = [(hammered, text) for text in facts(args.writes // 2, seed=2)]
        runs.append(await drive(client, f"{args.one_memory_clients} clients, one memory", one, args.one_memory_clients))
        return runs


async def raw_embedder(texts: list[str], batch: int) -> float:
    model = get_settings().embedding_model
    await embed_texts(texts[:batch], model=model)
    started = time.perf_counter()
    for i in range(0, len(texts), batch):
        await embed_texts(texts[i : i + batch], model=model)
    return len(texts) / (time.perf_counter() - started)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memories bench write", description=__doc__)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--writes", type=int, default=2000, help="writes per scenario")
    parser.add_argument("--memories", type=int, default=200)
    parser.add_argument("--one-memory-clients", type=int, default=50)
    args = parser.parse_args(argv)

    settings = get_settings()
    root = Path(tempfile.mkdtemp(prefix="memories-bench-"))
    servers: list[EmbeddedPostgres | EmbeddedNats] = []
    children: list[subprocess.Popen[bytes]] = []
    try:
        env = dict(os.environ, MEMORIES_ADMIN_TOKEN=TOKEN, MEMORIES_LOG_LEVEL="WARNING")
        if not settings.database_url:
            servers.append(EmbeddedPostgres(root / "postgres"))
            env["DATABASE_URL"] = servers[-1].start()
        if not settings.nats_url:
            servers.append(EmbeddedNats(root / "nats"))
            env["NATS_URL"] = servers[-1].start()
        upgrade(env["DATABASE_URL"])
        port = free_port()
        for command in (["writer"], ["api", "--port", str(port)]):
            children.append(subprocess.Popen([sys.executable, "-m", "services.cli", *command], env=env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
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
        runs = asyncio.run(scenarios(f"{base}/api/v1", args))
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)
        for server in reversed(servers):
            server.stop()
        shutil.rmtree(root, ignore_errors=True)
    embed_rate = asyncio.run(raw_embedder(facts(args.writes, seed=1), batch=64))

    print(f"{args.clients} clients, {args.writes} writes per scenario over {args.memories} memories; "
          f"embedder {settings.embedding_model}; {os.cpu_count()} cores\n")
    print("| scenario | writes | writes/s | p50 ms | p95 ms | p99 ms | actions |")
    print("|---|---|---|---|---|---|---|")
    for run in runs:
        print(run.row())
    created = len(runs[0].latencies) / runs[0].seconds
    print(f"| raw embedder, batches of 64 | {args.writes} | {embed_rate:,.0f} | | | | |")
    print(f"\nmany-memory writes / raw batched embedder = {created / embed_rate:.0%} (target ≥ 70 %)")
    return 0
