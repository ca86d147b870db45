"""Coalesce concurrent embedding requests into one model call.

Writers handle many partitions at once; each handler asks for one text. One batched call for 32 texts
costs far less than 32 calls, and no request waits for a timer: a batch is sent as soon as the previous
one returns, carrying whatever queued up meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

EmbedBatch = Callable[[list[str]], Awaitable[list[list[float]]]]


class BatchingEmbedder:
    def __init__(self, embed_batch: EmbedBatch, max_batch: int = 64) -> None:
        self._embed_batch = embed_batch
        self._max_batch = max_batch
        self._queue: list[tuple[str, asyncio.Future[list[float]]]] = []
        self._worker: asyncio.Task[None] | None = None

    async def __call__(self, texts: Sequence[str]) -> list[list[float]]:
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in texts]
        self._queue.extend(zip(texts, futures, strict=True))
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch :]
            try:
                vectors = await self._embed_batch([text for text, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiter of the batch gets the failure
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), vector in zip(batch, vectors, strict=True):
                if not future.done():
                    future.set_result(vector)
