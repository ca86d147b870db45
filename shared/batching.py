"""Coalesce concurrent calls of a batch function into fewer, larger calls.

A writer handles many partitions at once. Each partition's handler asks for its texts' embeddings, and
for its writes' decisions; one model call for 32 texts costs far less than 32 calls, and one transaction
for the writes of several partitions far less than one each. No caller waits for a timer: a batch is sent
as soon as the previous one returns, carrying whatever queued up meanwhile, in arrival order (a caller's
items stay together and in their order, so a partition's writes are still decided in sequence, in one call).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    def __init__(self, call_batch: Callable[[list[Item]], Awaitable[Sequence[Result]]], max_batch: int = 64) -> None:
        self._call_batch = call_batch
        self._max_batch = max_batch
        self._queue: list[list[tuple[Item, asyncio.Future[Result]]]] = []  # one group per caller
        self._worker: asyncio.Task[None] | None = None

    async def __call__(self, items: Sequence[Item]) -> list[Result]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._queue.append(list(zip(items, futures, strict=True)))
        if self._worker is None or self._worker.done():
            # In a context of its own: it serves every caller, so it must not log as the first one (its write id).
            self._worker = asyncio.create_task(self._drain(), context=contextvars.Context())
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
        while self._queue:
            batch = self._next_batch()
            try:
                results = await self._call_batch([item for item, _ in batch])
                if len(results) != len(batch):  # else some waiters would never be answered
                    raise ValueError(f"{len(results)} results for {len(batch)} items")
            except Exception as exc:  # noqa: BLE001 - every waiter of the batch gets the failure
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)

    def _next_batch(self) -> list[tuple[Item, asyncio.Future[Result]]]:
        """Whole callers' items, up to `max_batch` (at least one caller's, however many): a caller's items are never
        split across two calls, which would decide the later of them in a call of their own, maybe first."""
        batch = self._queue.pop(0)
        while self._queue and len(batch) + len(self._queue[0]) <= self._max_batch:
            batch.extend(self._queue.pop(0))
        return batch
