"""The API remembers which project a memory belongs to, so a write reads nothing before it is published."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from sqlalchemy import delete, event
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.owners import MemoryOwners
from shared.db.models import Memory
from shared.settings import Settings
from tests.conftest import open_api

_OWNER_LOOKUP = re.compile(r"SELECT memories\.project_id\s+FROM memories\s+WHERE")


@contextmanager
def owner_lookups() -> Iterator[list[str]]:
    """The owner lookups any engine of this process sends while the block runs."""
    seen: list[str] = []

    def note(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        if _OWNER_LOOKUP.match(statement):
            seen.append(statement)

    event.listen(Engine, "before_cursor_execute", note)
    try:
        yield seen
    finally:
        event.remove(Engine, "before_cursor_execute", note)


async def write(client: httpx.AsyncClient, memory_id: str, content: str) -> httpx.Response:
    return await client.post("/memory-entries", json={"memory_id": memory_id, "content": content})


async def test_only_the_first_write_to_a_memory_reads_its_owner(client: httpx.AsyncClient, memory: dict[str, Any]) -> None:
    with owner_lookups() as lookups:
        for n in range(3):
            response = await write(client, memory["id"], f"Delivery window number {n} is in the morning")
            assert response.status_code == 201, response.text
    assert len(lookups) == 1


async def new_memory(client: httpx.AsyncClient) -> str:
    project = (await client.post("/projects", json={"name": "owners"})).json()
    memory_id: str = (await client.post("/memories", json={"project_id": project["id"], "name": "notes"})).json()["id"]
    return memory_id


async def test_a_memory_deleted_by_another_process_is_404_from_the_writer_and_then_forgotten(
    settings: Settings, writers: list[Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The API still remembers the memory; the writer finds it gone, the answer is the same 404, and the API
    forgets it, so the next write is refused without the bus."""
    async with open_api(settings) as (app, client):
        memory_id = await new_memory(client)
        assert (await write(client, memory_id, "The office is in Lisbon")).status_code == 201
        async with sessions.begin() as session:  # as another API process would
            await session.execute(delete(Memory).where(Memory.id == memory_id))
        assert memory_id in app.state.memory_owners
        response = await write(client, memory_id, "The office moved to Porto")
        assert response.status_code == 404, response.text
        error = response.json()["error"]
        assert error["code"] == "RESOURCE_NOT_FOUND" and error["message"] == f"memory {memory_id} not found"
        assert memory_id not in app.state.memory_owners
        assert (await write(client, memory_id, "The office moved to Faro")).status_code == 404


async def test_a_tool_call_to_a_memory_deleted_by_another_process_forgets_it_too(
    settings: Settings, writers: list[Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    # Only REST writes forgot it: every later tool call was published and sent a writer a round trip for nothing.
    async with open_api(settings) as (app, client):
        memory_id = await new_memory(client)
        project_id = (await client.get(f"/memories/{memory_id}")).json()["project_id"]
        call = {"agent": {"knowledge_config": {"write_memory_id": memory_id}}, "project_id": project_id}
        first = await client.post("/tools/write_memory", json={**call, "content": "The depot opens at six"})
        assert first.status_code == 200 and first.json()["action"] == "created", first.text
        async with sessions.begin() as session:  # as another API process would
            await session.execute(delete(Memory).where(Memory.id == memory_id))
        assert memory_id in app.state.memory_owners
        gone = await client.post("/tools/write_memory", json={**call, "content": "The depot opens at seven"})
        assert "error" in gone.json(), gone.text
        assert memory_id not in app.state.memory_owners


async def test_deleting_a_memory_forgets_its_owner(settings: Settings, writers: list[Any]) -> None:
    async with open_api(settings) as (app, client):
        memory_id = await new_memory(client)
        assert (await write(client, memory_id, "Invoices go out on Fridays")).status_code == 201
        assert memory_id in app.state.memory_owners
        assert (await client.delete(f"/memories/{memory_id}")).status_code == 204
        assert memory_id not in app.state.memory_owners
        assert (await write(client, memory_id, "Invoices go out on Mondays")).status_code == 404


async def test_owners_keep_at_most_their_capacity_and_no_misses(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    ids = [
        (await client.post("/memories", json={"project_id": project["id"], "name": f"m{n}"})).json()["id"]
        for n in range(3)
    ]
    owners = MemoryOwners(capacity=2)
    async with sessions() as session:
        for memory_id in ids:
            assert await owners.project_of(session, memory_id) == project["id"]
        assert await owners.project_of(session, "mem_00000000000000000000000000") is None
    assert len(owners) == 2
    assert ids[0] not in owners and ids[1] in owners and ids[2] in owners
