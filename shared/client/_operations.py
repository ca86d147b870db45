"""Every REST operation of /api/v1 as a `Call` (see _calls.py); the clients expose each as a method.

The probes (/healthz, /readyz, /metrics) are not under /api/v1 and not here: they are for the platform running the
service, not for its callers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from shared.client._calls import UNSET, Call, Unset, dump, fields, model, nothing, page, present, query
from shared.client.errors import InvalidRequest, is_replayed
from shared.client.models import (
    AiProvider,
    ApiKey,
    ApiKeyCreated,
    DefaultModelRoute,
    EntryHistory,
    EntryWrite,
    ExtractionStatus,
    GenerationAccepted,
    KnowledgeContext,
    KnowledgeResult,
    Memory,
    MemoryEntry,
    ModelRoute,
    ModelUsage,
    Page,
    Project,
    ProvenanceCleared,
    ToolResult,
    WriteStatus,
)
from shared.events import SourceType, WriteAction, WritePolicy
from shared.ids import IDEMPOTENCY_KEY

Json = Mapping[str, Any]
TagValue = str | int | float | bool


def _id(value: str) -> str:
    if not value:  # "/memories/" is another route (the list)
        raise InvalidRequest(None, "INVALID_REQUEST", "an id must not be empty")
    # An id is one path segment, whatever a caller passes: `../projects` must not reach another route.
    return quote(value, safe="")


def _idempotency_key(value: str) -> str:
    # The service's rule, checked here too, so that a key it would refuse is refused the same way whether or not it
    # could be sent: a non-ASCII one cannot (a codec error from inside httpx), one with a space could (a 400).
    if not IDEMPOTENCY_KEY.fullmatch(value):
        raise InvalidRequest(
            None, "INVALID_REQUEST", "an Idempotency-Key must be 1 to 255 visible ASCII characters (no space, no accent)"
        )
    return value


# Projects (admin token) ---------------------------------------------------------------------------


def create_project(name: str) -> Call[Project]:
    return Call("POST", "/projects", model(Project), body={"name": name})


def list_projects(*, limit: int | None = None, offset: int | None = None) -> Call[Page[Project]]:
    return Call("GET", "/projects", page(Project), params=query(limit=limit, offset=offset))


# Memories -----------------------------------------------------------------------------------------


def create_memory(
    name: str,
    *,
    project_id: str | None = None,
    description: str | None = None,
    tags: Sequence[str] | None = None,
    write_policy: WritePolicy | str | None = None,
) -> Call[Memory]:
    """`project_id` may be left out with a key scoped to one project."""
    body = fields(
        name=name, project_id=project_id, description=description, tags=tags, write_policy=write_policy
    )
    return Call("POST", "/memories", model(Memory), body=body)


def list_memories(
    *,
    project_id: str | None = None,
    tags: Sequence[str] | None = None,
    limit: int | None = None,
    offset: int | None = None,
) -> Call[Page[Memory]]:
    """`tags` are globs (`*`, `?`, case-insensitive), ORed; one pattern may be given as a plain string."""
    patterns = [tags] if isinstance(tags, str) else list(tags or [])  # not one pattern per character
    params = query(project_id=project_id, tags=patterns, limit=limit, offset=offset)
    return Call("GET", "/memories", page(Memory), params=params)


def get_memory(memory_id: str) -> Call[Memory]:
    return Call("GET", f"/memories/{_id(memory_id)}", model(Memory))


def update_memory(
    memory_id: str,
    *,
    name: str | Unset = UNSET,
    description: str | None | Unset = UNSET,
    tags: Sequence[str] | None | Unset = UNSET,
    write_policy: WritePolicy | str | Unset = UNSET,
) -> Call[Memory]:
    """Only the arguments given change; None clears `description` or `tags`."""
    body = present(name=name, description=description, tags=tags, write_policy=write_policy)
    return Call("PUT", f"/memories/{_id(memory_id)}", model(Memory), body=body)


def delete_memory(memory_id: str) -> Call[None]:
    """Also deletes the memory's entries."""
    return Call("DELETE", f"/memories/{_id(memory_id)}", nothing)


# Memory entries -----------------------------------------------------------------------------------


def _entry_write(response: httpx.Response) -> EntryWrite:
    body = response.json()
    if response.status_code == httpx.codes.ACCEPTED:
        return EntryWrite(write_id=body["write_id"], status="pending")
    entry = MemoryEntry.model_validate(body)
    return EntryWrite(
        write_id=body["write_id"], status="applied", action=WriteAction(body["action"]), entry=entry,
        replayed=is_replayed(response),
    )


def create_entry(
    memory_id: str,
    content: str,
    *,
    tags: Sequence[str] | None = None,
    metadata: Json | None = None,
    source_type: SourceType | str | None = None,
    duplicate_threshold: float | None = None,
    write_policy: WritePolicy | str | None = None,
    idempotency_key: str | None = None,
) -> Call[EntryWrite]:
    """Write through the dedup algorithm: `.action` is created, skipped, updated or superseded. A retry with
    the same `idempotency_key` gets the first outcome back."""
    body = fields(
        memory_id=memory_id,
        content=content,
        tags=tags,
        metadata=metadata,
        source_type=source_type,
        duplicate_threshold=duplicate_threshold,
        write_policy=write_policy,
    )
    headers = {"Idempotency-Key": _idempotency_key(idempotency_key)} if idempotency_key is not None else {}
    return Call("POST", "/memory-entries", _entry_write, body=body, headers=headers)


def list_entries(
    memory_id: str,
    *,
    include_invalidated: bool = False,
    limit: int | None = None,
    offset: int | None = None,
) -> Call[Page[MemoryEntry]]:
    params = query(
        memory_id=memory_id, include_invalidated=include_invalidated or None, limit=limit, offset=offset
    )
    return Call("GET", "/memory-entries", page(MemoryEntry), params=params)


def get_entry(entry_id: str) -> Call[MemoryEntry]:
    """Invalidated entries too (audit)."""
    return Call("GET", f"/memory-entries/{_id(entry_id)}", model(MemoryEntry))


def update_entry(
    entry_id: str,
    *,
    content: str | Unset = UNSET,
    tags: Sequence[str] | None | Unset = UNSET,
    metadata: Json | None | Unset = UNSET,
) -> Call[MemoryEntry]:
    """Tags and metadata are replaced (None clears them); new content is re-embedded, never deduplicated."""
    body = present(content=content, tags=tags, metadata=metadata)
    return Call("PUT", f"/memory-entries/{_id(entry_id)}", model(MemoryEntry), body=body)


def delete_entry(entry_id: str) -> Call[None]:
    return Call("DELETE", f"/memory-entries/{_id(entry_id)}", nothing)


def entry_history(entry_id: str, *, limit: int | None = None, offset: int | None = None) -> Call[EntryHistory]:
    """A page of the decisions that touched the entry, oldest first."""
    params = query(limit=limit, offset=offset)
    return Call("GET", f"/memory-entries/{_id(entry_id)}/history", model(EntryHistory), params=params)


def get_write(write_id: str) -> Call[WriteStatus]:
    """The stored outcome of a write that answered pending."""
    return Call("GET", f"/memory-writes/{_id(write_id)}", model(WriteStatus))


# Knowledge ----------------------------------------------------------------------------------------


def _results(response: httpx.Response) -> list[KnowledgeResult]:
    return [KnowledgeResult.model_validate(item) for item in response.json()["results"]]


def search(
    query: str | None = None,
    *,
    memory_ids: Sequence[str] | None = None,
    memory_tags: Sequence[str] | None = None,
    limit: int | None = None,
    min_score: float | None = None,
    project_id: str | None = None,
) -> Call[list[KnowledgeResult]]:
    """Ranked by similarity with a `query`, oldest first without one; give a query or a filter."""
    body = fields(
        query=query,
        memory_ids=memory_ids,
        memory_tags=memory_tags,
        limit=limit,
        min_score=min_score,
        project_id=project_id,
    )
    return Call("POST", "/knowledge/search", _results, body=body)


def knowledge_context(
    knowledge_config: Json | BaseModel,
    message: str | None = None,
    *,
    project_id: str | None = None,
) -> Call[KnowledgeContext]:
    """The user-role reference message an agent's `knowledge_config` yields for the last user message."""
    body = fields(knowledge_config=dump(knowledge_config), message=message, project_id=project_id)
    return Call("POST", "/knowledge/context", model(KnowledgeContext), body=body)


# Agent paths --------------------------------------------------------------------------------------


def _json_object(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    if not isinstance(body, dict):  # a TypeError is read as a response that is not the API's
        raise TypeError(f"a JSON object was expected, not {type(body).__name__}")
    return body


def write_memory_tool() -> Call[dict[str, Any]]:
    """The `write_memory` tool definition, in the OpenAI tool format, to hand to a model as it is."""
    return Call("GET", "/tools/write_memory", _json_object)


def write_memory(
    content: str,
    agent: Json | BaseModel,
    *,
    generation_id: str | None = None,
    memory_id: str | None = None,
    project_id: str | None = None,
) -> Call[ToolResult]:
    """Execute a `write_memory` tool call; the target is the agent's `knowledge_config.write_memory_id`."""
    body = fields(
        content=content,
        agent=dump(agent),
        generation_id=generation_id,
        memory_id=memory_id,
        project_id=project_id,
    )
    return Call("POST", "/tools/write_memory", model(ToolResult), body=body)


def generation_completed(
    generation_id: str,
    agent: Json | BaseModel,
    *,
    messages: Sequence[Json] = (),
    output: str | None = None,
    conversation_id: str | None = None,
    extract: bool | None = None,
    streamed: bool = False,
    status: str = "completed",
    project_id: str | None = None,
    occurred_at: datetime | None = None,
) -> Call[GenerationAccepted]:
    """Report a finished model turn for automatic extraction; `extraction_status` tells the outcome.
    `occurred_at` is when the turn ended, for a turn reported late (a naive time is read as UTC): a forgetting of
    its generation or conversation made after it does not apply to its facts."""
    body = fields(
        generation_id=generation_id,
        agent=dump(agent),
        messages=[dict(message) for message in messages],
        output=output,
        conversation_id=conversation_id,
        extract=extract,
        streamed=streamed,
        status=status,
        project_id=project_id,
        occurred_at=occurred_at.isoformat() if occurred_at is not None else None,
    )
    return Call("POST", "/generations/completed", model(GenerationAccepted), body=body)


def extraction_status(generation_id: str, *, project_id: str | None = None) -> Call[ExtractionStatus]:
    # A "/" in the id is sent as %2F: the route takes it whole (`:path`), and `..` cannot reach another route.
    path = f"/generations/{_id(generation_id)}/extraction"
    return Call("GET", path, model(ExtractionStatus), params=query(project_id=project_id))


def orchestration_write(
    memory_id: str,
    content: Any,
    *,
    tags: Sequence[str] | Mapping[str, TagValue] | None = None,
    metadata: Json | None = None,
    source_type: SourceType | str | None = None,
    idempotency_key: str | None = None,
) -> Call[EntryWrite]:
    """An orchestration `memory_write` node's write: `content` is the mapped input (anything but a string is
    stored JSON-encoded), `tags` a list or a `{key: value}` map stored as `key:value` tags. It never merges
    (exact duplicates are still skipped); the outcome and the `idempotency_key` replay are those of `create_entry`."""
    body = fields(
        memory_id=memory_id,
        content=content,
        tags=dict(tags) if isinstance(tags, Mapping) else tags,
        metadata=metadata,
        source_type=source_type,
    )
    headers = {"Idempotency-Key": _idempotency_key(idempotency_key)} if idempotency_key is not None else {}
    return Call("POST", "/orchestration/memory-write", _entry_write, body=body, headers=headers)


# Provenance ---------------------------------------------------------------------------------------


def forget_generation(generation_id: str, *, project_id: str | None = None) -> Call[ProvenanceCleared]:
    """A generation was deleted: its entries stop citing it, the facts stay. `.cleared` counts the entries."""
    path = f"/generations/{_id(generation_id)}/provenance"  # a "/" as in `extraction_status`
    return Call("DELETE", path, model(ProvenanceCleared), params=query(project_id=project_id))


def forget_conversation(conversation_id: str, *, project_id: str | None = None) -> Call[ProvenanceCleared]:
    """A conversation was deleted: its entries stop citing it, the facts stay. `.cleared` counts the entries."""
    path = f"/conversations/{_id(conversation_id)}/provenance"
    return Call("DELETE", path, model(ProvenanceCleared), params=query(project_id=project_id))


# Model registry (admin token) ---------------------------------------------------------------------


def create_ai_provider(
    name: str,
    provider: str,
    *,
    project_id: str | None = None,
    api_base: str | None = None,
    api_key_env: str | None = None,
    default_model: str | None = None,
) -> Call[AiProvider]:
    """`provider` is litellm's prefix (`openai`); `api_key_env` names the service's environment variable holding
    the key, never the key itself."""
    body = fields(
        project_id=project_id,
        name=name,
        provider=provider,
        api_base=api_base,
        api_key_env=api_key_env,
        default_model=default_model,
    )
    return Call("POST", "/ai-providers", model(AiProvider), body=body)


def list_ai_providers(
    *, project_id: str | None = None, limit: int | None = None, offset: int | None = None
) -> Call[Page[AiProvider]]:
    params = query(project_id=project_id, limit=limit, offset=offset)
    return Call("GET", "/ai-providers", page(AiProvider), params=params)


def delete_ai_provider(provider_id: str) -> Call[None]:
    """Refused (Conflict, with the `model_route_ids` in `.meta`) while a model route targets it."""
    return Call("DELETE", f"/ai-providers/{_id(provider_id)}", nothing)


def create_model_route(
    name: str, targets: Sequence[Json | BaseModel], *, project_id: str | None = None
) -> Call[ModelRoute]:
    """`targets` (1 to 10: `{ai_provider_id, model?}` or `ModelRouteTarget`) are tried in order, failing over;
    a target without a model uses its provider's `default_model`."""
    body = fields(project_id=project_id, name=name, targets=[dump(target) for target in targets])
    return Call("POST", "/model-routes", model(ModelRoute), body=body)


def list_model_routes(
    *, project_id: str | None = None, limit: int | None = None, offset: int | None = None
) -> Call[Page[ModelRoute]]:
    params = query(project_id=project_id, limit=limit, offset=offset)
    return Call("GET", "/model-routes", page(ModelRoute), params=params)


def delete_model_route(route_id: str) -> Call[None]:
    """Also clears the project's default route if it was this one."""
    return Call("DELETE", f"/model-routes/{_id(route_id)}", nothing)


def get_default_model_route(project_id: str) -> Call[DefaultModelRoute]:
    """The route a project's agents use when they name no model (`.model_route_id` None: none set)."""
    return Call("GET", f"/projects/{_id(project_id)}/default-model-route", model(DefaultModelRoute))


def set_default_model_route(project_id: str, model_route_id: str | None) -> Call[DefaultModelRoute]:
    """None clears the default."""
    path = f"/projects/{_id(project_id)}/default-model-route"
    # Not `fields`: the null that clears must be sent.
    return Call("PUT", path, model(DefaultModelRoute), body={"model_route_id": model_route_id})


def usage(
    *, project_id: str | None = None, limit: int | None = None, offset: int | None = None
) -> Call[Page[ModelUsage]]:
    """The project's LLM calls and tokens, one row per provider, model and purpose (extraction, merge, …)."""
    params = query(project_id=project_id, limit=limit, offset=offset)
    return Call("GET", "/usage", page(ModelUsage), params=params)


# API keys (admin token) ---------------------------------------------------------------------------


def create_api_key(
    project_id: str, actions: Sequence[str], *, name: str | None = None
) -> Call[ApiKeyCreated]:
    """`actions` are IAM actions or patterns (`memories:*`); the secret is in `.key`, shown only here."""
    body = fields(project_id=project_id, actions=list(actions), name=name)
    return Call("POST", "/api-keys", model(ApiKeyCreated), body=body)


def list_api_keys(
    *,
    project_id: str | None = None,
    include_revoked: bool = False,
    limit: int | None = None,
    offset: int | None = None,
) -> Call[Page[ApiKey]]:
    params = query(project_id=project_id, include_revoked=include_revoked or None, limit=limit, offset=offset)
    return Call("GET", "/api-keys", page(ApiKey), params=params)


def revoke_api_key(key_id: str) -> Call[None]:
    return Call("DELETE", f"/api-keys/{_id(key_id)}", nothing)
