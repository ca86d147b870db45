"""List paging as the contract says: limit defaults to 50 and is clamped to 1..100; offset >= 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Query

from services.api.schemas import Page


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int


async def paging(  # async: a plain def dependency runs in the thread pool
    limit: Annotated[int, Query(description="page size, clamped to 1..100")] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1)] = 0,
) -> Paging:
    return Paging(limit=min(max(limit, 1), 100), offset=offset)


PagingDep = Annotated[Paging, Depends(paging)]
Item = TypeVar("Item")


def page_of(items: list[Item], paging: Paging) -> Page[Item]:
    """A page of a list read whole (a project's providers, routes, usage groups: a handful); larger lists are
    paged in SQL (`repository._page`)."""
    chosen = items[paging.offset : paging.offset + paging.limit]
    return Page(data=chosen, total=len(items), limit=paging.limit, offset=paging.offset)
