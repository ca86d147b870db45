"""List paging as the contract says: limit defaults to 50 and is clamped to 1..100; offset >= 0."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, TypeVar

from fastapi import Depends, Query
from pydantic import BeforeValidator

from services.api.schemas import Page


@dataclass(frozen=True)
class Paging:
    limit: int
    offset: int


def _digits(value: object) -> object:
    # Python's int() reads "1_0" as 10, " 3 " as 3, and pydantic "5.0" as 5: a client's typo is a 400, not a guess.
    if isinstance(value, str) and not re.fullmatch(r"-?[0-9]+", value):
        raise ValueError("must be a whole number written in digits")
    return value


Digits = BeforeValidator(_digits)


def _true_or_false(value: object) -> object:
    # Pydantic reads "yes", "on", "1", "t" as true: a client's guess is a 400, as a number's is. Any case: Python's
    # urlencode (requests) writes True as "True".
    if isinstance(value, str) and value.lower() not in ("true", "false"):
        raise ValueError("must be true or false")
    return value


Flag = Annotated[bool, BeforeValidator(_true_or_false)]
"""A query parameter's boolean, written as JSON writes one."""


async def paging(  # async: a plain def dependency runs in the thread pool
    # The bounds before the validator: after one, pydantic publishes them as `ge`/`le`, which JSON Schema lacks.
    limit: Annotated[int, Query(description="page size, clamped to 1..100"), Digits] = 50,
    offset: Annotated[int, Query(ge=0, le=2**31 - 1), Digits] = 0,
) -> Paging:
    return Paging(limit=min(max(limit, 1), 100), offset=offset)


PagingDep = Annotated[Paging, Depends(paging)]
Item = TypeVar("Item")


def page_of(items: list[Item], paging: Paging) -> Page[Item]:
    """A page of a list read whole (a project's providers, routes, usage groups: a handful); larger lists are
    paged in SQL (`repository._page`, then `paged`)."""
    return paged(items[paging.offset : paging.offset + paging.limit], len(items), paging)


def paged(chosen: list[Item], total: int, paging: Paging) -> Page[Item]:
    """The page's items, with the total of the list they were chosen from."""
    return Page(data=chosen, total=total, limit=paging.limit, offset=paging.offset)
