"""Faults, with nothing lost: real processes and servers killed or restarted under load.

Each test drives writes through a `memories api` subprocess to `memories writer` subprocesses, with a client
that retries 503 and 202 with the same Idempotency-Key, then checks the tables against a calm run of the same
writes (tests/faultkit.py). One system (PostgreSQL, NATS, API, two writers) is shared by the tests of one
server; the cluster test has its own. docs/reliability.md records what these runs measured.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import nats
import pytest
import pytest_asyncio

from shared import bus
from tests.faultkit import (
    Load,
    System,
    admin_client,
    assert_applied_exactly_once,
    create_memories,
    drive,
    plan_writes,
    running_system,
)

WRITERS = ["writer-a", "writer-b"]


def report(name: str, load: Load, started: float, **facts: object) -> None:
    """One line per run, shown with -s; the numbers of docs/reliability.md come from it."""
    details = " ".join(f"{key}={value}" for key, value in facts.items())
    print(f"\n[{name}] {time.monotonic() - started:.1f}s statuses={dict(load.statuses)} "
          f"transport_errors={load.transport_errors} {details}")


@pytest_asyncio.fixture(scope="module")
async def system() -> AsyncIterator[System]:
    """Two writer replicas bound to every partition, as an operator scales them."""
    with running_system() as started:
        await started.ensure_running(WRITERS)
        yield started


@pytest.mark.slow
async def test_two_writer_processes_make_one_entry_of_50_identical_writes(system: System) -> None:
    await system.ensure_running(WRITERS)
    _, (memory_id,) = await create_memories(system, 1)
    body = {"memory_id": memory_id, "content": "The customer's account number is 991"}
    async with admin_client(system) as client:
        responses = await asyncio.gather(*(client.post("/memory-entries", json=body) for _ in range(50)))
        assert sorted(r.json()["action"] for r in responses) == ["created"] + ["skipped"] * 49
        assert len({r.json()["id"] for r in responses}) == 1
        listed = (await client.get("/memory-entries", params={"memory_id": memory_id})).json()
    assert listed["total"] == 1


@pytest.mark.slow
async def test_kill_9_of_writers_under_2000_writes_loses_and_doubles_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 20)
    writes = plan_writes(memory_ids, per_memory=100, repeats=30)  # 1,400 distinct facts, 600 exact copies
    load = Load()
    kills: list[str] = []

    async def crash_writers() -> None:
        await load.wait_for(len(writes) * 3 // 10, timeout=120)
        system.kill("writer-a")  # mid-load: it holds up to one write per partition, some mid-transaction
        kills.append(f"writer-a@{len(load.results)}")
        await system.start_writer("writer-a")
        await load.wait_for(len(writes) * 6 // 10, timeout=120)
        system.kill("writer-a")  # then every writer at once: nothing runs until they are back
        system.kill("writer-b")
        kills.append(f"both@{len(load.results)}")
        await asyncio.gather(*(system.start_writer(name) for name in WRITERS))

    started = time.monotonic()
    await asyncio.gather(crash_writers(), drive(system, writes, load, deadline_s=200))
    report("kill -9 writers", load, started, writes=len(writes), kills=kills)
    await assert_applied_exactly_once(system, project_id, writes, load)


def assert_outage_answers(load: Load, start: float, end: float, allowed: set[int]) -> None:
    """While a server is down, the API says 503 (or 202: queued, or a decision it already has), never 500."""
    during = load.statuses_between(start, end)
    assert during[503] >= 1, f"no 503 while the server was down: {during}"
    assert set(during) <= allowed, during
    assert load.samples[503]["error"]["code"] == "SERVICE_UNAVAILABLE"


@pytest.mark.slow
async def test_nats_restart_under_load_answers_503_and_loses_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 8)
    writes = plan_writes(memory_ids, per_memory=40, repeats=10, seed=11)
    load = Load()
    nats_server = system.nats[0]
    window: list[float] = []

    async def restart_nats() -> None:
        await load.wait_for(len(writes) // 4, timeout=60)
        await asyncio.to_thread(nats_server.stop)  # file storage: the streams come back with it
        window.append(time.monotonic())
        try:
            await asyncio.sleep(6)  # longer than the gateway's publish timeout
        finally:
            window.append(time.monotonic())
            await asyncio.to_thread(nats_server.start)

    started = time.monotonic()
    await asyncio.gather(restart_nats(), drive(system, writes, load))
    report("NATS restart", load, started, writes=len(writes), down_s=round(window[1] - window[0], 1),
           during=dict(load.statuses_between(*window)))
    # A retry of a write decided before the outage is answered from the database: 200/201 are fine.
    assert_outage_answers(load, window[0], window[1], {503, 202, 200, 201})
    await assert_applied_exactly_once(system, project_id, writes, load)


@pytest.mark.slow
async def test_postgres_restart_under_load_answers_503_and_loses_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 8)
    writes = plan_writes(memory_ids, per_memory=40, repeats=10, seed=13)
    load = Load()
    window: list[float] = []

    async def restart_postgres() -> None:
        await load.wait_for(len(writes) // 4, timeout=60)
        await asyncio.to_thread(system.postgres.stop)
        # Answers sent just before the stop may arrive just after it.
        window.append(time.monotonic() + 0.5)
        try:
            await asyncio.sleep(5)
        finally:
            window.append(time.monotonic())
            await asyncio.to_thread(system.postgres.start)

    started = time.monotonic()
    await asyncio.gather(restart_postgres(), drive(system, writes, load))
    report("PostgreSQL restart", load, started, writes=len(writes), down_s=round(window[1] - window[0] + 0.5, 1),
           during=dict(load.statuses_between(*window)))
    # Every answer needs the database except a 202 (the writer did not answer in time): 503 or 202 only.
    assert_outage_answers(load, window[0], window[1], {503, 202})
    await assert_applied_exactly_once(system, project_id, writes, load)


async def stream_leader(system: System, stream: str) -> str:
    nc = await nats.connect(system.nats_url.split(","), connect_timeout=5)
    try:
        info = await nc.jetstream().stream_info(stream)
    finally:
        await nc.close()
    assert info.cluster is not None and info.cluster.leader
    return info.cluster.leader


@pytest.mark.slow
async def test_losing_the_leader_of_a_three_node_cluster_loses_nothing() -> None:
    with running_system(nats_nodes=3) as system:
        await system.ensure_running(WRITERS[:1])
        project_id, memory_ids = await create_memories(system, 8)
        writes = plan_writes(memory_ids, per_memory=40, repeats=10, seed=17)
        load = Load()
        killed: list[str] = []

        async def kill_leader() -> None:
            await load.wait_for(len(writes) // 4, timeout=60)
            # The node leading MEMORY_WRITES: its loss costs an election, the hardest single-node loss.
            leader = await stream_leader(system, bus.WRITES_STREAM)
            next(node for node in system.nats if node.name == leader).kill()
            killed.append(leader)

        started = time.monotonic()
        await asyncio.gather(kill_leader(), drive(system, writes, load))
        new_leader = await stream_leader(system, bus.WRITES_STREAM)
        report("3-node cluster, leader killed", load, started, writes=len(writes), killed=killed,
               new_leader=new_leader)
        assert new_leader not in killed
        await assert_applied_exactly_once(system, project_id, writes, load)


async def test_api_stays_ready_only_while_both_servers_are(system: System) -> None:
    """/readyz tells a load balancer to stop routing to an API whose bus is down, and to resume after."""
    await system.ensure_running(WRITERS)
    nats_server = system.nats[0]
    async with httpx.AsyncClient(base_url=system.api_url, timeout=10) as client:
        assert (await client.get("/readyz")).status_code == 200
        await asyncio.to_thread(nats_server.stop)
        try:
            deadline = time.monotonic() + 5
            while (down := await client.get("/readyz")).status_code == 200 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
        finally:
            await asyncio.to_thread(nats_server.start)
        assert down.status_code == 503 and down.json()["checks"]["bus"] == "unavailable"
        deadline = time.monotonic() + 20
        while (await client.get("/readyz")).status_code != 200:
            assert time.monotonic() < deadline, "the API did not reconnect to NATS"
            await asyncio.sleep(0.2)
