"""`MemoriesClient` (blocking) and `AsyncMemoriesClient` (asyncio): the same operations, sent over httpx."""

from __future__ import annotations

import json
from types import TracebackType
from typing import Any, Self, TypeVar

import httpx

from shared.client import _operations as op
from shared.client._calls import Call, async_operation, sync_operation
from shared.client.errors import InvalidRequest, MemoriesError, raise_for_error, unsent_or_unanswered

T = TypeVar("T")
H = TypeVar("H", httpx.Client, httpx.AsyncClient)

DEFAULT_URL = "http://127.0.0.1:8000"
API_PREFIX = "/api/v1"
DEFAULT_TIMEOUT_S = 30.0


def api_base(url: str) -> str:
    """The service's URL with or without the /api/v1 suffix: the base every path is relative to."""
    base = url.rstrip("/")
    return base if base.endswith(API_PREFIX) else base + API_PREFIX


def _settings(url: str, token: str | None, timeout: float) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return {"base_url": api_base(url), "headers": headers, "timeout": timeout}


def _http_client(kind: type[H], url: str, token: str | None, timeout: float, transport: Any) -> H:
    try:
        return kind(transport=transport, **_settings(url, token, timeout))
    except (httpx.InvalidURL, ValueError) as exc:  # a malformed URL, a token that is no header value
        raise unsent_or_unanswered(exc, url) from exc


def _request(call: Call[Any]) -> dict[str, Any]:
    request: dict[str, Any] = {"params": call.params, "headers": dict(call.headers)}
    if call.body is not None:
        # Encoded here, as httpx would, so that a body JSON cannot carry (a set, an object, NaN) is refused as
        # the request it is, not raised as a TypeError from inside httpx.
        try:
            request["content"] = json.dumps(call.body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InvalidRequest(None, "INVALID_REQUEST", f"the request cannot be sent: {exc}") from exc
        request["headers"]["Content-Type"] = "application/json"
    return request


def _read(call: Call[T], response: httpx.Response) -> T:
    raise_for_error(response)
    try:
        return call.read(response)
    except (ValueError, KeyError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        # A success that is not the API's JSON: something else answered at this URL.
        raise MemoriesError(
            response.status_code, "INVALID_RESPONSE", f"unexpected response body: {exc}"
        ) from exc


class MemoriesClient:
    """Blocking client. `transport` (e.g. `httpx.WSGITransport`, `httpx.MockTransport`) replaces the network;
    `http` replaces the whole `httpx.Client` (its base_url must end in /api/v1). Close it, or use `with`."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        http: httpx.Client | None = None,
    ) -> None:
        self._http = http or _http_client(httpx.Client, url, token, timeout, transport)
        self._owns_http = http is None

    def send(self, call: Call[T]) -> T:
        try:
            response = self._http.request(call.method, call.path, **_request(call))
        except (httpx.TransportError, httpx.InvalidURL, ValueError) as exc:
            raise unsent_or_unanswered(exc, str(self._http.base_url)) from exc
        return _read(call, response)

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    create_project = sync_operation(op.create_project)
    list_projects = sync_operation(op.list_projects)
    create_memory = sync_operation(op.create_memory)
    list_memories = sync_operation(op.list_memories)
    get_memory = sync_operation(op.get_memory)
    update_memory = sync_operation(op.update_memory)
    delete_memory = sync_operation(op.delete_memory)
    create_entry = sync_operation(op.create_entry)
    list_entries = sync_operation(op.list_entries)
    get_entry = sync_operation(op.get_entry)
    update_entry = sync_operation(op.update_entry)
    delete_entry = sync_operation(op.delete_entry)
    entry_history = sync_operation(op.entry_history)
    get_write = sync_operation(op.get_write)
    search = sync_operation(op.search)
    knowledge_context = sync_operation(op.knowledge_context)
    write_memory_tool = sync_operation(op.write_memory_tool)
    write_memory = sync_operation(op.write_memory)
    orchestration_write = sync_operation(op.orchestration_write)
    generation_completed = sync_operation(op.generation_completed)
    extraction_status = sync_operation(op.extraction_status)
    forget_generation = sync_operation(op.forget_generation)
    forget_conversation = sync_operation(op.forget_conversation)
    create_ai_provider = sync_operation(op.create_ai_provider)
    list_ai_providers = sync_operation(op.list_ai_providers)
    delete_ai_provider = sync_operation(op.delete_ai_provider)
    create_model_route = sync_operation(op.create_model_route)
    list_model_routes = sync_operation(op.list_model_routes)
    delete_model_route = sync_operation(op.delete_model_route)
    get_default_model_route = sync_operation(op.get_default_model_route)
    set_default_model_route = sync_operation(op.set_default_model_route)
    usage = sync_operation(op.usage)
    create_api_key = sync_operation(op.create_api_key)
    list_api_keys = sync_operation(op.list_api_keys)
    revoke_api_key = sync_operation(op.revoke_api_key)


class AsyncMemoriesClient:
    """asyncio client. `transport` (e.g. `httpx.ASGITransport(app)`) replaces the network; `http` replaces
    the whole `httpx.AsyncClient` (its base_url must end in /api/v1). Close it, or use `async with`."""

    def __init__(
        self,
        url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> None:
        self._http = http or _http_client(httpx.AsyncClient, url, token, timeout, transport)
        self._owns_http = http is None

    async def send(self, call: Call[T]) -> T:
        try:
            response = await self._http.request(call.method, call.path, **_request(call))
        except (httpx.TransportError, httpx.InvalidURL, ValueError) as exc:
            raise unsent_or_unanswered(exc, str(self._http.base_url)) from exc
        return _read(call, response)

    async def aclose(self) -> None:
        if self._owns_http:
            await self._http.aclose()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    create_project = async_operation(op.create_project)
    list_projects = async_operation(op.list_projects)
    create_memory = async_operation(op.create_memory)
    list_memories = async_operation(op.list_memories)
    get_memory = async_operation(op.get_memory)
    update_memory = async_operation(op.update_memory)
    delete_memory = async_operation(op.delete_memory)
    create_entry = async_operation(op.create_entry)
    list_entries = async_operation(op.list_entries)
    get_entry = async_operation(op.get_entry)
    update_entry = async_operation(op.update_entry)
    delete_entry = async_operation(op.delete_entry)
    entry_history = async_operation(op.entry_history)
    get_write = async_operation(op.get_write)
    search = async_operation(op.search)
    knowledge_context = async_operation(op.knowledge_context)
    write_memory_tool = async_operation(op.write_memory_tool)
    write_memory = async_operation(op.write_memory)
    orchestration_write = async_operation(op.orchestration_write)
    generation_completed = async_operation(op.generation_completed)
    extraction_status = async_operation(op.extraction_status)
    forget_generation = async_operation(op.forget_generation)
    forget_conversation = async_operation(op.forget_conversation)
    create_ai_provider = async_operation(op.create_ai_provider)
    list_ai_providers = async_operation(op.list_ai_providers)
    delete_ai_provider = async_operation(op.delete_ai_provider)
    create_model_route = async_operation(op.create_model_route)
    list_model_routes = async_operation(op.list_model_routes)
    delete_model_route = async_operation(op.delete_model_route)
    get_default_model_route = async_operation(op.get_default_model_route)
    set_default_model_route = async_operation(op.set_default_model_route)
    usage = async_operation(op.usage)
    create_api_key = async_operation(op.create_api_key)
    list_api_keys = async_operation(op.list_api_keys)
    revoke_api_key = async_operation(op.revoke_api_key)
