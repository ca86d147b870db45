"""The one request-building layer under both clients.

An operation is a plain function that returns a `Call`: the request to make and how to read its response.
It does no I/O, so the blocking and the asyncio client share every operation, each only sending the call
its own way. `sync_operation` / `async_operation` turn an operation into a client method with the
operation's own signature, which keeps both clients fully typed without writing either twice.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, Protocol, TypeVar, overload

import httpx
from pydantic import BaseModel

from shared.client.models import Page, Result

T = TypeVar("T")
P = ParamSpec("P")
M = TypeVar("M", bound=Result)


class Unset(enum.Enum):
    """Marks an argument left out, where None has a meaning of its own (a PUT's null clears the field)."""

    UNSET = enum.auto()


UNSET = Unset.UNSET

Query = list[tuple[str, str | int | float | bool]]


@dataclass(frozen=True)
class Call(Generic[T]):
    method: str
    path: str
    read: Callable[[httpx.Response], T]
    params: Query = field(default_factory=list)
    body: Mapping[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)


def fields(**values: Any) -> dict[str, Any]:
    """A JSON body of the fields given: None and UNSET are left out (the service's defaults apply)."""
    return {name: value for name, value in values.items() if value is not None and value is not UNSET}


def present(**values: Any) -> dict[str, Any]:
    """A partial update: every field but the UNSET ones, so that an explicit None reaches the service."""
    return {name: value for name, value in values.items() if value is not UNSET}


def query(**values: Any) -> Query:
    """Query parameters; a list repeats its key (`tags=a*&tags=b?`), None is left out."""
    pairs: Query = []
    for name, value in values.items():
        for item in value if isinstance(value, list | tuple) else [value]:
            if item is not None:
                pairs.append((name, item))
    return pairs


def model(kind: type[M]) -> Callable[[httpx.Response], M]:
    return lambda response: kind.model_validate(response.json())


def page(kind: type[M]) -> Callable[[httpx.Response], Page[M]]:
    return lambda response: Page[kind].model_validate(response.json())  # type: ignore[valid-type]


def nothing(_response: httpx.Response) -> None:
    return None


def dump(value: BaseModel | Mapping[str, Any]) -> dict[str, Any]:
    return value.model_dump(mode="json", exclude_none=True) if isinstance(value, BaseModel) else dict(value)


class SyncSender(Protocol):
    def send(self, call: Call[T]) -> T: ...


class AsyncSender(Protocol):
    def send(self, call: Call[T]) -> Awaitable[T]: ...


class sync_operation(Generic[P, T]):
    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type) -> sync_operation[P, T]: ...
    @overload
    def __get__(self, client: SyncSender, owner: type) -> Callable[P, T]: ...
    def __get__(self, client: SyncSender | None, owner: type) -> sync_operation[P, T] | Callable[P, T]:
        if client is None:
            return self
        build = self._build

        @functools.wraps(build, assigned=("__name__", "__qualname__", "__doc__"), updated=())
        def method(*args: P.args, **kwargs: P.kwargs) -> T:
            return client.send(build(*args, **kwargs))

        return method


class async_operation(Generic[P, T]):
    def __init__(self, build: Callable[P, Call[T]]) -> None:
        self._build = build
        self.__doc__ = build.__doc__

    @overload
    def __get__(self, client: None, owner: type) -> async_operation[P, T]: ...
    @overload
    def __get__(self, client: AsyncSender, owner: type) -> Callable[P, Awaitable[T]]: ...
    def __get__(
        self, client: AsyncSender | None, owner: type
    ) -> async_operation[P, T] | Callable[P, Awaitable[T]]:
        if client is None:
            return self
        build = self._build

        @functools.wraps(build, assigned=("__name__", "__qualname__", "__doc__"), updated=())
        async def method(*args: P.args, **kwargs: P.kwargs) -> T:
            return await client.send(build(*args, **kwargs))

        return method
