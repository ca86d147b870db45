"""API keys seen live, remembered briefly by each API process so that a request need not read its key."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from shared import bus, iam
from shared import repository as repo
from shared.events import ApiKeyRevoked
from shared.ids import new_id

log = logging.getLogger("memories.api")


@dataclass(frozen=True, slots=True)
class LiveKey:
    id: str
    project_id: str
    actions: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Remembered:
    key: LiveKey
    expires_at: float  # time.monotonic()
    reconnects: int  # the NATS connection's reconnect count when it was remembered


class LiveKeys:
    """Unrevoked keys by secret hash, each for at most `ttl_s` seconds.

    Reading the key was half of the API's CPU for a write (measured in docs/benchmarks.md). A revocation
    still takes effect at once: the revoking process forgets the key before it answers, and broadcasts the
    revocation over core NATS to the other API processes, which forget it as it arrives (milliseconds). A
    broadcast can be missed only while a process's NATS connection is down, so a remembered key is trusted
    only while the connection is up and has not reconnected since; `ttl_s` bounds anything else (0: read
    the key on every request). Secrets that match no live key are never remembered.
    """

    def __init__(self, nc: NatsClient, ttl_s: float, capacity: int = 10_000) -> None:
        self._nc = nc
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._by_hash: dict[str, _Remembered] = {}
        self._forgotten = 0  # revocations seen: a read that overlapped one may predate it, so is not kept

    async def start(self) -> None:
        await self._nc.subscribe(bus.API_KEY_REVOKED_SUBJECT, cb=self._on_revoked)

    async def lookup(self, session: AsyncSession, secret: str) -> LiveKey | None:
        digest = iam.secret_hash(secret)
        remembered = self._by_hash.get(digest)
        if remembered is not None and self._trusts(remembered):
            return remembered.key
        forgotten_before = self._forgotten
        row = await repo.get_live_api_key(session, digest)
        if row is None:
            self._by_hash.pop(digest, None)
            return None
        key = LiveKey(row.id, row.project_id, frozenset(row.actions))
        if self._ttl_s > 0 and self._nc.is_connected and self._forgotten == forgotten_before:
            self._remember(digest, key)
        return key

    async def revoked(self, key_id: str) -> None:
        """After the revocation committed: forget the key here, then tell the other API processes."""
        self.forget(key_id)
        event = ApiKeyRevoked(event_id=new_id("evt_"), key_id=key_id)
        try:
            await self._nc.publish(bus.API_KEY_REVOKED_SUBJECT, event.model_dump_json().encode())
            await self._nc.flush(timeout=2)
        except Exception as exc:  # noqa: BLE001 - the revocation is committed; the answer must not fail now
            log.warning("could not broadcast the revocation of %s; other API processes forget it within %s s: %s",
                        key_id, self._ttl_s, exc)

    def forget(self, key_id: str) -> None:
        self._forgotten += 1
        for digest in [d for d, r in self._by_hash.items() if r.key.id == key_id]:
            del self._by_hash[digest]

    def __len__(self) -> int:
        return len(self._by_hash)

    def _trusts(self, remembered: _Remembered) -> bool:
        return (
            time.monotonic() < remembered.expires_at
            and self._nc.is_connected
            and self._nc.stats["reconnects"] == remembered.reconnects
        )

    def _remember(self, digest: str, key: LiveKey) -> None:
        if digest not in self._by_hash and len(self._by_hash) >= self._capacity:
            del self._by_hash[next(iter(self._by_hash))]  # the oldest: a dict keeps insertion order
        expires_at = time.monotonic() + self._ttl_s
        self._by_hash[digest] = _Remembered(key, expires_at, self._nc.stats["reconnects"])

    async def _on_revoked(self, message: Msg) -> None:
        try:
            event = ApiKeyRevoked.model_validate_json(message.data)
        except ValidationError as exc:
            log.warning("ignoring a malformed key revocation: %s", exc.errors()[:3])
            return
        self.forget(event.key_id)
