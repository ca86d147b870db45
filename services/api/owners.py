"""Which project each memory belongs to, remembered by the API for the write path."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncSession

from shared import repository as repo


class MemoryOwners:
    """A memory's project, read once and then remembered.

    Before a write is published the API only has to know that the memory is the caller's. A memory never
    moves to another project and its id is never reused, so a remembered owner is never wrong. A memory
    deleted since is the writer's to catch: it checks the memory under its lock and answers
    RESOURCE_NOT_FOUND, which the API returns as the same 404 and then forgets the memory. Ids that name no
    memory are not remembered, so made-up ids cannot fill the table.
    """

    def __init__(self, capacity: int = 20_000) -> None:
        self._capacity = capacity
        self._owners: dict[str, str] = {}

    async def project_of(self, session: AsyncSession, memory_id: str) -> str | None:
        owner = self._owners.get(memory_id)
        if owner is None:
            owner = await repo.get_memory_project(session, memory_id)
            if owner is not None:
                self._remember(memory_id, owner)
        return owner

    def forget(self, memory_id: str) -> None:
        self._owners.pop(memory_id, None)

    def __len__(self) -> int:
        return len(self._owners)

    def __contains__(self, memory_id: object) -> bool:
        return memory_id in self._owners

    def _remember(self, memory_id: str, owner: str) -> None:
        if len(self._owners) >= self._capacity:
            del self._owners[next(iter(self._owners))]  # the oldest: a dict keeps insertion order
        self._owners[memory_id] = owner
