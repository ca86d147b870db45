"""`memories bench extract`: extraction throughput with 1, 2 and 4 extractor replicas (processes).

The model is the scripted provider with a fixed latency (default 200 ms), so the table measures the
pipeline and its scaling, not a provider. Each event is a completed turn whose extraction yields the same
few facts (after the first event they are exact copies, which the writer skips without an embedding), so
the writer is not what limits the run. Replicas share the one durable consumer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import nats
from sqlalchemy import func, select

from services.bench._system import bench_environment
from shared import bus
from shared import repository as repo
from shared.db.models import GenerationExtraction
from shared.db.session import create_engine, session_factory
from shared.events import GenerationAgent, GenerationCompleted
from shared.settings import get_settings

FACTS = ["The user lives in Porto", "The user is allergic to peanuts"]


async def run_once(env: dict[str, str], replicas: int, events: int) -> float:
    """Seconds from the first publish until every event's extraction is stored."""
    engine = create_engine(env["DATABASE_URL"], pool_size=2)
    sessions = session_factory(engine)
    async with sessions.begin() as session:
        project = await repo.create_project(session, f"bench-{replicas}")
        memory = await repo.create_memory(
            session, project_id=project.id, name="m", description=None, tags=None, write_policy="seed"
        )
    children = [
        subprocess.Popen(  # noqa: ASYNC220 - started once, before the measurement
            [sys.executable, "-m", "services.cli", "extractor"], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(replicas)
    ]
    nc = await nats.connect(env["NATS_URL"])
    try:
        await bus.ensure_layout(nc.jetstream(), get_settings(), bus.Role.ADMIN)
        await asyncio.sleep(8)  # the replicas import their libraries and bind to the consumer
        agent = GenerationAgent(model="scripted/bench", knowledge_config={"write_memory_id": memory.id, "extraction": True})
        started = time.perf_counter()
        for i in range(events):
            event = GenerationCompleted(
                event_id=f"evt_{replicas}_{i}", project_id=project.id, generation_id=f"gen_{i}", agent=agent,
                messages=[{"role": "user", "content": "I live in Porto and I am allergic to peanuts."}],
            )
            await nc.jetstream().publish(
                bus.generation_completed_subject(project.id), event.model_dump_json().encode(),
                stream=bus.GENERATIONS_STREAM,
            )
        while True:
            async with sessions() as session:
                done = await session.scalar(
                    select(func.count()).where(
                        GenerationExtraction.project_id == project.id, GenerationExtraction.status == "completed"
                    )
                )
            if done >= events:
                return time.perf_counter() - started
            await asyncio.sleep(0.1)
    finally:
        await nc.close()
        for child in children:
            child.terminate()
        for child in children:
            child.wait(timeout=30)
        await engine.dispose()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="memories bench extract", description=__doc__)
    parser.add_argument("--events", type=int, default=40, help="events per replica count (scaled by replicas)")
    parser.add_argument("--latency", type=float, default=0.2, help="scripted model latency, seconds")
    parser.add_argument("--concurrency", type=int, default=1, help="turns one replica works on at once")
    parser.add_argument("--replicas", default="1,2,4")
    args = parser.parse_args(argv)

    results: list[tuple[int, int, float]] = []
    script = {"bench": {"reply": json.dumps(FACTS), "latency_s": args.latency}}
    with bench_environment(
        MEMORIES_SCRIPTED_LLM=json.dumps(script), MEMORIES_EXTRACTOR_CONCURRENCY=str(args.concurrency)
    ) as env:
        writer = subprocess.Popen([sys.executable, "-m", "services.cli", "writer"], env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for replicas in (int(r) for r in args.replicas.split(",")):
                events = args.events * replicas
                results.append((replicas, events, asyncio.run(run_once(env, replicas, events))))
        finally:
            writer.terminate()
            writer.wait(timeout=30)

    base = results[0][1] / results[0][2]
    print(f"scripted model latency {args.latency * 1000:.0f} ms, {args.concurrency} turn(s) at once per replica, "
          f"{len(FACTS)} facts per turn; {os.cpu_count()} cores\n")
    print("| replicas | events | seconds | events/s | speed-up |")
    print("|---|---|---|---|---|")
    for replicas, events, seconds in results:
        rate = events / seconds
        print(f"| {replicas} | {events} | {seconds:.1f} | {rate:.1f} | {rate / base:.2f}× |")
    print("\ntargets: ≥ 1.8× at 2 replicas, ≥ 3.2× at 4")
    return 0
