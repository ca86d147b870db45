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
from sqlalchemy import text

from shared import bus
from shared.db.session import create_engine, session_factory
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
          f"longest_stall={load.longest_stall():.1f}s transport_errors={len(load.transport_errors)} {details}")


@pytest_asyncio.fixture(scope="module")
async def system() -> AsyncIterator[System]:
    """Two writer replicas pulling every partition (JetStream serves each to one), as an operator scales them."""
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
        decisions = [await decision_of(client, response) for response in responses]
        assert sorted(action for action, _ in decisions) == ["created"] + ["skipped"] * 49
        assert len({entry_id for _, entry_id in decisions}) == 1
        listed = (await client.get("/memory-entries", params={"memory_id": memory_id})).json()
    assert listed["total"] == 1


async def decision_of(client: httpx.AsyncClient, response: httpx.Response, timeout: float = 30) -> tuple[str, str]:
    """(action, entry id) of a write's answer; a 202 (the writer was slower than the write timeout) is
    followed up through /memory-writes."""
    if response.status_code != 202:
        assert response.status_code in (200, 201), response.text
        return response.json()["action"], response.json()["id"]
    deadline = time.monotonic() + timeout
    while (status := (await client.get(f"/memory-writes/{response.json()['write_id']}")).json())["status"] == "pending":
        assert time.monotonic() < deadline, "the write stayed pending"
        await asyncio.sleep(0.1)
    return status["action"], status["entry_id"]


@pytest.mark.slow
async def test_writers_killed_or_frozen_under_2000_writes_lose_and_double_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 20)
    writes = plan_writes(memory_ids, per_memory=100, repeats=30)  # 1,400 distinct facts, 600 exact copies
    load = Load()
    faults: list[str] = []

    async def crash_writers() -> None:
        await load.wait_for(len(writes) // 4, timeout=120)
        system.kill("writer-a")  # mid-load: it holds up to one write per partition, some mid-transaction
        faults.append(f"kill -9 writer-a @{len(load.results)}")
        await system.start_writer("writer-a")
        await load.wait_for(len(writes) // 2, timeout=120)
        # Stalled past the ack wait and the pin's timeout (3 + 5 s): writer-b's partitions pass to writer-a, which
        # gets the writes writer-b holds, and writer-b then finishes them too (the pin is no lock). Both apply each
        # of them; only the write-outcome record keeps that to one effect.
        faults.append(f"SIGSTOP writer-b 10s @{len(load.results)}")
        await system.freeze("writer-b", seconds=10)
        await load.wait_for(len(writes) * 3 // 4, timeout=120)
        system.kill("writer-a")  # then every writer at once: nothing runs until they are back
        system.kill("writer-b")
        faults.append(f"kill -9 both @{len(load.results)}")
        await asyncio.gather(*(system.start_writer(name) for name in WRITERS))

    started = time.monotonic()
    await asyncio.gather(crash_writers(), drive(system, writes, load, deadline_s=200))
    report("writers killed and frozen", load, started, writes=len(writes), faults=faults)
    await assert_applied_exactly_once(system, project_id, writes, load)


def assert_outage_answers(
    load: Load, start: float, end: float, allowed: set[int], *, refused_by_the_load: bool = True
) -> None:
    """While a server is down, the API says 503 (or 202: queued, or a decision it already has), never 500.
    `refused_by_the_load`: some of the load's own writes met the outage with a 503."""
    during = load.statuses_between(start, end)
    if refused_by_the_load:
        assert during[503] >= 1, f"no 503 while the server was down: {during}"
        assert load.samples[503]["error"]["code"] == "SERVICE_UNAVAILABLE"
    assert set(during) <= allowed, during


@pytest.mark.slow
async def test_nats_restart_under_load_answers_503_and_loses_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 8)
    _, (probed,) = await create_memories(system, 1)  # another project's: the load's tables stay as planned
    writes = plan_writes(memory_ids, per_memory=40, repeats=10, seed=11)
    load = Load()
    nats_server = system.nats[0]
    window: list[float] = []
    probe: list[httpx.Response] = []

    async def restart_nats() -> None:
        await load.wait_for(len(writes) // 4, timeout=60)
        await asyncio.to_thread(nats_server.stop)  # file storage: the streams come back with it
        window.append(time.monotonic())
        try:
            # A new write meets the outage, whatever the load does (on a busy machine every client may be waiting
            # for a decision published before the stop: those are answered 202, and their retries too).
            await asyncio.sleep(1)
            async with admin_client(system) as client:
                probe.append(await client.post("/memory-entries", json={"memory_id": probed, "content": "A probe"}))
            await asyncio.sleep(5)  # longer than the gateway's publish timeout
        finally:
            window.append(time.monotonic())
            await asyncio.to_thread(nats_server.start)

    started = time.monotonic()
    await asyncio.gather(restart_nats(), drive(system, writes, load))
    report("NATS restart", load, started, writes=len(writes), down_s=round(window[1] - window[0], 1),
           during=dict(load.statuses_between(*window)))
    # A retry of a write decided before the outage is answered from the database: 200/201 are fine.
    assert_outage_answers(load, window[0], window[1], {503, 202, 200, 201}, refused_by_the_load=False)
    assert probe[0].status_code == 503, probe[0].text
    assert probe[0].json()["error"]["code"] == "SERVICE_UNAVAILABLE" and "was not sent" in probe[0].json()["error"]["message"]
    await assert_applied_exactly_once(system, project_id, writes, load)


@pytest.mark.slow
async def test_postgres_restart_under_load_answers_503_and_loses_nothing(system: System) -> None:
    await system.ensure_running(WRITERS)
    project_id, memory_ids = await create_memories(system, 8)
    writes = plan_writes(memory_ids, per_memory=40, repeats=10, seed=13)
    load = Load()
    window: list[float] = []
    probe: list[httpx.Response] = []

    async def restart_postgres() -> None:
        await load.wait_for(len(writes) // 4, timeout=60)
        await asyncio.to_thread(system.postgres.stop)
        # Answers sent just before the stop may arrive just after it.
        window.append(time.monotonic() + 0.5)
        try:
            # A read meets the outage, whatever the load does (every client may be waiting for a decision the
            # writer cannot make now: answered 202 at the write timeout, with no request of theirs in the window).
            await asyncio.sleep(1)
            async with admin_client(system) as client:
                probe.append(await client.get(f"/memories/{memory_ids[0]}"))
            await asyncio.sleep(4)
        finally:
            window.append(time.monotonic())
            await asyncio.to_thread(system.postgres.start)

    started = time.monotonic()
    await asyncio.gather(restart_postgres(), drive(system, writes, load))
    report("PostgreSQL restart", load, started, writes=len(writes), down_s=round(window[1] - window[0] + 0.5, 1),
           during=dict(load.statuses_between(*window)))
    # Every answer needs the database except a 202 (the writer did not answer in time): 503 or 202 only.
    assert_outage_answers(load, window[0], window[1], {503, 202}, refused_by_the_load=False)
    assert probe[0].status_code == 503, probe[0].text
    assert probe[0].json()["error"]["code"] == "SERVICE_UNAVAILABLE"
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


async def bus_check(probe: httpx.AsyncClient) -> str:
    return str((await probe.get("/readyz")).json()["checks"]["bus"])


async def test_an_api_whose_bus_is_down_stays_ready_for_reads_and_says_so(system: System) -> None:
    """Every replica shares the bus: were it a condition of readiness, its outage would take every API out of the
    load balancer, reads and searches too, which need only the database. Writes answer 503 meanwhile."""
    await system.ensure_running(WRITERS)
    project_id, (memory_id,) = await create_memories(system, 1)
    nats_server = system.nats[0]
    async with admin_client(system) as client, httpx.AsyncClient(base_url=system.api_url, timeout=10) as probe:
        assert (await probe.get("/readyz")).json() == {"status": "ready", "checks": {"database": "ok", "bus": "ok"}}
        await asyncio.to_thread(nats_server.stop)
        try:
            deadline = time.monotonic() + 5
            while await bus_check(probe) == "ok" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            down = await probe.get("/readyz")
            read = await client.get(f"/memories/{memory_id}")
            written = await client.post("/memory-entries", json={"memory_id": memory_id, "content": "Not now"})
        finally:
            await asyncio.to_thread(nats_server.start)
        assert down.status_code == 200 and down.json() == {
            "status": "degraded", "checks": {"database": "ok", "bus": "unavailable"}
        }
        assert read.status_code == 200 and read.json()["project_id"] == project_id
        assert written.status_code == 503, written.text
        deadline = time.monotonic() + 20
        while await bus_check(probe) != "ok":
            assert time.monotonic() < deadline, "the API did not reconnect to NATS"
            await asyncio.sleep(0.2)


async def test_a_write_refused_while_nats_is_down_goes_through_on_its_first_retry(system: System) -> None:
    """A 503 must not leave the write claimed: the first retry after the outage publishes it at once,
    rather than waiting for the claim to go stale. Nor may a refused turn reach the stream after all."""
    await system.ensure_running(WRITERS)
    project_id, (memory_id,) = await create_memories(system, 1)
    body = {"memory_id": memory_id, "content": "Refused once, then written"}
    headers = {"Idempotency-Key": "refused-then-written"}
    turn = {"project_id": project_id, "generation_id": "gen_refused", "agent": {}, "messages": []}
    turns_before = await stream_messages(system, bus.GENERATIONS_STREAM)
    async with admin_client(system) as client, httpx.AsyncClient(base_url=system.api_url, timeout=10) as probe:
        await asyncio.to_thread(system.nats[0].stop)
        try:
            deadline = time.monotonic() + 5
            while await bus_check(probe) == "ok" and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            refused = await client.post("/memory-entries", json=body, headers=headers)
            refused_turn = await client.post("/generations/completed", json=turn)
        finally:
            await asyncio.to_thread(system.nats[0].start)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "SERVICE_UNAVAILABLE"
        assert refused_turn.status_code == 503, refused_turn.text
        deadline = time.monotonic() + 20
        while await bus_check(probe) != "ok":
            assert time.monotonic() < deadline, "the API did not reconnect to NATS"
            await asyncio.sleep(0.2)
        retried = await client.post("/memory-entries", json=body, headers=headers)
        assert retried.status_code == 201, retried.text
        # The turn told 503 was not buffered by the client and published on reconnection behind its back.
        await asyncio.sleep(1.0)
        assert await stream_messages(system, bus.GENERATIONS_STREAM) == turns_before


async def stream_messages(system: System, stream: str) -> int:
    nc = await nats.connect(system.nats_url)
    try:
        return int((await nc.jetstream().stream_info(stream)).state.messages)
    finally:
        await nc.close()


async def test_a_session_whose_connection_was_dropped_closes_without_raising(system: System) -> None:
    """The API's session dependency closes its session after the response has started: a raise there (the
    rollback on a connection a PostgreSQL restart dropped) would drop the client's connection."""
    await system.ensure_running(WRITERS)
    engine = create_engine(system.env["DATABASE_URL"], pool_size=1)
    try:
        async with session_factory(engine)() as session:
            backend = (await session.execute(text("SELECT pg_backend_pid()"))).scalar_one()
            with system.postgres.connect() as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (backend,))
        async with session_factory(engine)() as session:  # the pool recovers: a new connection
            assert (await session.execute(text("SELECT 1"))).scalar_one() == 1
    finally:
        await engine.dispose()
