"""Each API process remembers live API keys briefly; a revocation still takes effect at once, everywhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import nats
import pytest_asyncio
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from sqlalchemy import func, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from services.api.keys import LiveKeys
from shared import bus
from shared.db.models import ApiKey
from shared.events import ApiKeyRevoked
from shared.settings import Settings
from tests.conftest import open_api


async def new_key(client: httpx.AsyncClient, project: dict[str, Any]) -> tuple[str, str]:
    body = {"project_id": project["id"], "name": "cached", "actions": ["memories:*"]}
    created = (await client.post("/api-keys", json=body)).json()
    return created["id"], created["key"]


async def list_with(client: httpx.AsyncClient, secret: str) -> int:
    response = await client.get("/memories", headers={"Authorization": f"Bearer {secret}"})
    return response.status_code


async def revoke_behind_the_apis_back(sessions: async_sessionmaker[AsyncSession], key_id: str) -> None:
    """As if a broadcast were lost: the row is revoked, no API process is told."""
    async with sessions.begin() as session:
        await session.execute(update(ApiKey).where(ApiKey.id == key_id).values(revoked_at=func.now()))


@pytest_asyncio.fixture
async def keys_bus(settings: Settings) -> AsyncIterator[NatsClient]:
    """A connection of its own to the real bus, which hears none of its own messages (as if the other API
    processes were elsewhere)."""
    assert settings.nats_url
    nc = await nats.connect(settings.nats_url, no_echo=True)
    yield nc
    if not nc.is_closed:
        await nc.close()


@pytest_asyncio.fixture
async def keys(keys_bus: NatsClient) -> LiveKeys:
    live = LiveKeys(keys_bus, ttl_s=300.0)
    await live.start()
    return live


async def test_a_key_revoked_through_one_api_process_is_refused_by_another(
    settings: Settings, project: dict[str, Any]
) -> None:
    remembering = settings.model_copy(update={"memories_api_key_cache_s": 300.0})
    async with open_api(remembering) as (first, first_client), open_api(remembering) as (second, second_client):
        key_id, secret = await new_key(first_client, project)
        assert await list_with(first_client, secret) == 200 and await list_with(second_client, secret) == 200
        assert len(first.state.live_keys) == 1 and len(second.state.live_keys) == 1  # both remember it
        assert (await first_client.delete(f"/api-keys/{key_id}")).status_code == 204
        # Answered once both had forgotten it: the other process's 300 s are cut short by the broadcast alone.
        assert len(first.state.live_keys) == 0 and len(second.state.live_keys) == 0
        assert await list_with(first_client, secret) == 401 and await list_with(second_client, secret) == 401


async def test_without_a_cache_time_every_request_reads_the_key(
    settings: Settings, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    async with open_api(settings.model_copy(update={"memories_api_key_cache_s": 0.0})) as (app, client):
        key_id, secret = await new_key(client, project)
        assert await list_with(client, secret) == 200 and len(app.state.live_keys) == 0
        await revoke_behind_the_apis_back(sessions, key_id)
        assert await list_with(client, secret) == 401


async def test_a_remembered_key_is_not_trusted_without_the_bus_that_would_carry_its_revocation(
    keys: LiveKeys, keys_bus: NatsClient, client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    key_id, secret = await new_key(client, project)
    async with sessions() as session:
        remembered = await keys.lookup(session, secret)
        assert remembered is not None and remembered.id == key_id and remembered.project_id == project["id"]
        await revoke_behind_the_apis_back(sessions, key_id)
        assert await keys.lookup(session, secret) == remembered  # connected: trusted
        await keys_bus.close()  # a revocation broadcast now could be missed
        assert await keys.lookup(session, secret) is None


async def test_a_read_that_overlapped_a_revocation_is_not_remembered(
    keys: LiveKeys, client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The read may have seen the row before the revocation committed: keeping it would serve a revoked key."""
    key_id, secret = await new_key(client, project)
    async with sessions() as session:
        reading = asyncio.create_task(keys.lookup(session, secret))
        await asyncio.sleep(0)  # the lookup is now waiting on the database
        keys.forget(key_id)  # a revocation arrives meanwhile
        assert (await reading) is not None  # the read itself saw the key live
        assert len(keys) == 0
        assert await keys.lookup(session, secret) is not None and len(keys) == 1  # no overlap: kept


async def test_revoking_forgets_here_broadcasts_and_an_unreadable_broadcast_forgets_all(
    keys: LiveKeys,
    settings: Settings,
    client: httpx.AsyncClient,
    project: dict[str, Any],
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    assert settings.nats_url
    other = await nats.connect(settings.nats_url, no_echo=True)  # another API process, as the bus sees it
    heard: asyncio.Queue[bytes] = asyncio.Queue()

    async def forget_and_say_so(message: Msg) -> None:
        await heard.put(message.data)
        await message.respond(b"")

    try:
        await other.subscribe(bus.API_KEY_REVOKED_SUBJECT, cb=forget_and_say_so)
        await other.flush()
        first_id, first = await new_key(client, project)
        _, second = await new_key(client, project)
        async with sessions() as session:
            assert await keys.lookup(session, first) is not None and await keys.lookup(session, second) is not None
        assert len(keys) == 2
        await keys.revoked(first_id)  # its own broadcast does not come back: only the local forget removes it
        assert len(keys) == 1
        assert ApiKeyRevoked.model_validate_json(heard.get_nowait()).key_id == first_id  # heard before answered
        # Another version's revocation, unreadable here: every key is forgotten, and the sender told so.
        await other.request(bus.API_KEY_REVOKED_SUBJECT, b'{"key_id": "key_x", "version": 2}', timeout=5)
        assert len(keys) == 0
    finally:
        await other.close()


class BusState:
    """Stands in for the NATS client's connection state where a test needs one it cannot bring about on
    demand (a reconnect); the other tests use the real bus."""

    def __init__(self) -> None:
        self.is_connected = True
        self.stats = {"reconnects": 0}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_remembered_key_is_read_again_after_the_cache_time_or_a_reconnect(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    key_id, secret = await new_key(client, project)
    state, clock = BusState(), Clock()
    keys = LiveKeys(state, ttl_s=10.0, clock=clock)  # type: ignore[arg-type]
    async with sessions() as session:
        assert await keys.lookup(session, secret) is not None
        await revoke_behind_the_apis_back(sessions, key_id)
        clock.now += 9.9
        assert await keys.lookup(session, secret) is not None  # remembered: not read
        clock.now += 0.2
        assert await keys.lookup(session, secret) is None  # expired: read, and refused

        key_id, secret = await new_key(client, project)
        assert await keys.lookup(session, secret) is not None
        await revoke_behind_the_apis_back(sessions, key_id)
        state.stats["reconnects"] += 1  # a broadcast may have been missed meanwhile
        assert await keys.lookup(session, secret) is None

        key_id, secret = await new_key(client, project)
        reading = asyncio.create_task(keys.lookup(session, secret))
        await asyncio.sleep(0)
        state.stats["reconnects"] += 1  # the connection dropped and came back during the read
        assert (await reading) is not None and len(keys) == 0
