"""Each API process remembers live API keys briefly; a revocation still takes effect at once, everywhere."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
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
    settings: Settings, client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    key_id, secret = await new_key(client, project)
    assert settings.nats_url
    nc = await bus.connect(settings.nats_url, name="live-keys-test")
    keys = LiveKeys(nc, ttl_s=300.0)
    async with sessions() as session:
        remembered = await keys.lookup(session, secret)
        assert remembered is not None and remembered.id == key_id and remembered.project_id == project["id"]
        await revoke_behind_the_apis_back(sessions, key_id)
        assert await keys.lookup(session, secret) == remembered  # connected: trusted
        await nc.close()  # a revocation broadcast now could be missed
        assert await keys.lookup(session, secret) is None


async def test_a_read_that_overlapped_a_revocation_is_not_remembered(
    settings: Settings, client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    """The read may have seen the row before the revocation committed: keeping it would serve a revoked key."""
    key_id, secret = await new_key(client, project)
    assert settings.nats_url
    nc = await bus.connect(settings.nats_url, name="live-keys-race")
    keys = LiveKeys(nc, ttl_s=300.0)
    try:
        async with sessions() as session:
            reading = asyncio.create_task(keys.lookup(session, secret))
            await asyncio.sleep(0)  # the lookup is now waiting on the database
            keys.forget(key_id)  # a revocation arrives meanwhile
            assert (await reading) is not None  # the read itself saw the key live
            assert len(keys) == 0
            assert await keys.lookup(session, secret) is not None and len(keys) == 1  # no overlap: kept
    finally:
        await nc.close()


class BusState:
    """Stands in for the NATS client where a test needs a connection state it cannot bring about on demand
    (a reconnect), and sees what would be broadcast; the tests above use the real bus."""

    def __init__(self) -> None:
        self.is_connected = True
        self.stats = {"reconnects": 0}
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        self.published.append((subject, data))

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Any) -> SimpleNamespace:
        async def unsubscribe() -> None:
            return None

        return SimpleNamespace(unsubscribe=unsubscribe)


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


async def test_revoking_forgets_here_and_broadcasts_and_an_unreadable_broadcast_forgets_all(
    client: httpx.AsyncClient, project: dict[str, Any], sessions: async_sessionmaker[AsyncSession]
) -> None:
    state = BusState()
    keys = LiveKeys(state, ttl_s=300.0)  # type: ignore[arg-type]
    first_id, first = await new_key(client, project)
    _, second = await new_key(client, project)
    async with sessions() as session:
        assert await keys.lookup(session, first) is not None and await keys.lookup(session, second) is not None
    assert len(keys) == 2
    await keys.revoked(first_id)  # this stand-in echoes nothing back: only the local forget can remove it
    assert len(keys) == 1
    [(subject, data)] = state.published
    assert subject == bus.API_KEY_REVOKED_SUBJECT and ApiKeyRevoked.model_validate_json(data).key_id == first_id
    unreadable = SimpleNamespace(data=b'{"key_id": "key_x", "version": 2}', reply="_INBOX.revoker")
    await keys.on_revoked(unreadable)  # type: ignore[arg-type]
    assert len(keys) == 0
    assert state.published[-1][0] == "_INBOX.revoker"  # the revoker is told it was forgotten
