"""API keys seen live, remembered briefly by each API process so that a request need not read its key."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from shared import bus, iam
from shared import repository as repo
from shared.events import ApiKeyRevoked
from shared.ids import EVENT_PREFIX, new_id

log = logging.getLogger("memories.api")

REVOCATION_QUIET_S = 0.05
"""How long a revocation waits, after the last API process said it forgot the key, for another one to."""
REVOCATION_WAIT_S = 2.0


async def _until_quiet(replies: asyncio.Queue[Msg]) -> None:
    deadline = asyncio.get_running_loop().time() + REVOCATION_WAIT_S
    while (left := deadline - asyncio.get_running_loop().time()) > 0:
        try:
            await asyncio.wait_for(replies.get(), min(REVOCATION_QUIET_S, left))
        except TimeoutError:
            return


@dataclass(frozen=True, slots=True)
class LiveKey:
    id: str
    project_id: str
    actions: frozenset[str]


@dataclass(frozen=True, slots=True)
class _Remembered:
    key: LiveKey
    expires_at: float  # on the LiveKeys clock
    reconnects: int  # the NATS connection's reconnect count before the key was read


class LiveKeys:
    """Unrevoked keys by secret hash, each for at most `ttl_s` seconds.

    Reading the key was half of the API's CPU for a write (measured in docs/benchmarks.md). A revocation
    takes effect at once wherever the broadcast is read: it goes over core NATS, each API process forgets the
    key and says so, and the revoking request is answered when those replies stop coming (REVOCATION_QUIET_S
    without one): a process too busy to reply in time (frozen, overloaded) forgets the key when it reads the
    broadcast, and may accept it until then, at most `ttl_s`. A remembered key is trusted only while the
    process's NATS connection is up and has not reconnected since the key was read, so a broadcast missed
    while disconnected cannot keep a revoked key alive; `ttl_s` bounds every other way to miss one (a lost
    message, a crash between the commit and the broadcast, a half-open connection not yet noticed). 0 reads
    the key on every request. Secrets that match no live key are never remembered.
    """

    def __init__(
        self, nc: NatsClient, ttl_s: float, capacity: int = 10_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._nc = nc
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._clock = clock
        self._by_hash: dict[str, _Remembered] = {}
        self._forgotten = 0  # revocations seen: a read that overlapped one may predate it, so is not kept

    async def start(self) -> None:
        await self._nc.subscribe(bus.API_KEY_REVOKED_SUBJECT, cb=self.on_revoked)

    async def lookup(self, session: AsyncSession, secret: str) -> LiveKey | None:
        digest = iam.secret_hash(secret)
        remembered = self._by_hash.get(digest)
        if remembered is not None and self._trusts(remembered):
            return remembered.key
        before = self._revocations_seen()
        row = await repo.get_live_api_key(session, digest)
        if row is None:
            self._by_hash.pop(digest, None)
            return None
        key = LiveKey(row.id, row.project_id, frozenset(row.actions))
        # Kept only if no revocation could have been missed while it was read.
        if self._ttl_s > 0 and self._nc.is_connected and self._revocations_seen() == before:
            self._remember(digest, _Remembered(key, self._clock() + self._ttl_s, reconnects=before[1]))
        return key

    async def revoked(self, key_id: str) -> None:
        """After the revocation committed: forget the key here, tell the other API processes, and return once
        they have said they forgot it (replies are collected until REVOCATION_QUIET_S passes without one, at
        most REVOCATION_WAIT_S), so the next request anywhere is refused."""
        self.forget(key_id)
        event = ApiKeyRevoked(event_id=new_id(EVENT_PREFIX), key_id=key_id)
        replies: asyncio.Queue[Msg] = asyncio.Queue()
        try:
            inbox = self._nc.new_inbox()
            subscription = await self._nc.subscribe(inbox, cb=replies.put)
            try:
                await self._nc.publish(bus.API_KEY_REVOKED_SUBJECT, event.model_dump_json().encode(), reply=inbox)
                await _until_quiet(replies)
            finally:
                await subscription.unsubscribe()
        except Exception:  # the revocation is committed; its answer must not fail now
            log.exception("could not broadcast the revocation of %s: other API processes may accept it for up to "
                          "%s s", key_id, self._ttl_s)

    def forget(self, key_id: str | None) -> None:
        """Forget a key, or every key (None)."""
        self._forgotten += 1
        for digest in [d for d, r in self._by_hash.items() if key_id is None or r.key.id == key_id]:
            del self._by_hash[digest]

    async def on_revoked(self, message: Msg) -> None:
        try:
            key_id: str | None = ApiKeyRevoked.model_validate_json(message.data).key_id
        except ValidationError as exc:
            # Some revocation, unreadable (another version of the service?): forget every key, not none.
            log.warning("unreadable key revocation, forgetting every key: %s", exc.errors()[:3])
            key_id = None
        self.forget(key_id)
        if message.reply:
            await self._nc.publish(message.reply, b"")

    def __len__(self) -> int:
        return len(self._by_hash)

    def _revocations_seen(self) -> tuple[int, int]:
        """(revocations received, NATS reconnects): when either moves, a revocation may have been missed."""
        return self._forgotten, int(self._nc.stats["reconnects"])

    def _trusts(self, remembered: _Remembered) -> bool:
        return (
            self._clock() < remembered.expires_at
            and self._nc.is_connected
            and int(self._nc.stats["reconnects"]) == remembered.reconnects
        )

    def _remember(self, digest: str, remembered: _Remembered) -> None:
        self._by_hash.pop(digest, None)  # re-inserted last: the newest
        if len(self._by_hash) >= self._capacity:
            now = self._clock()
            for stale in [d for d, r in self._by_hash.items() if r.expires_at <= now]:
                del self._by_hash[stale]
        if len(self._by_hash) >= self._capacity:
            del self._by_hash[next(iter(self._by_hash))]  # the oldest: a dict keeps insertion order
        self._by_hash[digest] = remembered
