"""Two extractor processes share one durable consumer: they split the turns, and when one is killed mid
extraction its turn comes back to the other after the ack wait. Nothing is lost, nothing written twice."""

from __future__ import annotations

import asyncio
import json
import time

import nats
import pytest
from sqlalchemy import func, select

from shared import bus
from shared import repository as repo
from shared.db.models import GenerationExtraction, MemoryEntry
from shared.db.session import create_engine, session_factory
from shared.events import GenerationAgent, GenerationCompleted
from tests.faultkit import running_system

TURNS = 8
LATENCY_S = 2.0


UNRELATED = [
    "The office cat is called Pixel", "Invoices are paid by bank transfer", "The team deploys on Thursdays",
    "Maria is allergic to shellfish", "The Lisbon warehouse closes at six", "Our VPN uses WireGuard",
    "The quarterly budget is forty thousand euros", "Support tickets close after ten days",
    "The CEO prefers handwritten notes", "Parking spot 12 belongs to Tomas", "The wiki runs on a Raspberry Pi",
    "Lunch is catered on Fridays", "The printer on floor three jams often", "Backups run at midnight",
    "The logo is teal and orange", "Interns start in September",
]


def facts(turn: int) -> list[str]:
    # Far apart for the embedder, so no two of them fall in the merge band.
    return UNRELATED[2 * turn : 2 * turn + 2]


@pytest.mark.slow
async def test_replicas_split_turns_and_a_killed_one_loses_nothing() -> None:
    script = {f"turn{i}": {"reply": json.dumps(facts(i)), "latency_s": LATENCY_S} for i in range(TURNS)}
    with running_system(MEMORIES_SCRIPTED_LLM=json.dumps(script), MEMORIES_EXTRACTOR_CONCURRENCY="2") as system:
        await system.start_writer()
        for name in ("extractor-a", "extractor-b"):
            system._spawn(name, "extractor")
        engine = create_engine(system.env["DATABASE_URL"], pool_size=2)
        sessions = session_factory(engine)
        nc = await nats.connect(system.nats_url)
        try:
            async with sessions.begin() as session:
                project = await repo.create_project(session, "replicas")
                memory = await repo.create_memory(
                    session, project_id=project.id, name="m", description=None, tags=None, write_policy="seed"
                )
            js = nc.jetstream()
            deadline = time.monotonic() + 60
            while (await js.consumer_info(bus.GENERATIONS_STREAM, bus.EXTRACTOR_DURABLE)).num_waiting < 2:
                assert time.monotonic() < deadline, system.log_tail("extractor-a") + system.log_tail("extractor-b")
                await asyncio.sleep(0.2)
            for i in range(TURNS):
                agent = GenerationAgent(
                    model=f"scripted/turn{i}", knowledge_config={"write_memory_id": memory.id, "extraction": True}
                )
                event = GenerationCompleted(
                    event_id=f"evt_{i}", project_id=project.id, generation_id=f"gen_{i}", agent=agent,
                    messages=[{"role": "user", "content": "facts"}],
                )
                await js.publish(bus.generation_completed_subject(project.id), event.model_dump_json().encode(),
                                 stream=bus.GENERATIONS_STREAM)
            while (await js.consumer_info(bus.GENERATIONS_STREAM, bus.EXTRACTOR_DURABLE)).num_ack_pending < 3:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            # Two replicas × two turns at once: with three in flight the one killed holds at least one turn.
            system.kill("extractor-a")

            async def completed() -> int:
                async with sessions() as session:
                    return int(await session.scalar(select(func.count()).where(
                        GenerationExtraction.project_id == project.id, GenerationExtraction.status == "completed"
                    )) or 0)

            deadline = time.monotonic() + 90
            while await completed() < TURNS:
                assert time.monotonic() < deadline, system.log_tail("extractor-b")
                await asyncio.sleep(0.2)
            async with sessions() as session:
                contents = list(await session.scalars(select(MemoryEntry.content).where(MemoryEntry.memory_id == memory.id)))
            assert sorted(contents) == sorted(fact for i in range(TURNS) for fact in facts(i))
            info = await js.consumer_info(bus.GENERATIONS_STREAM, bus.EXTRACTOR_DURABLE)
            assert info.num_pending == 0 and info.num_ack_pending == 0
            assert "extraction completed" in system.log_tail("extractor-b", 400)
        finally:
            await nc.close()
            await engine.dispose()
