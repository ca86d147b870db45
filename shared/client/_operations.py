"""Every REST operation of /api/v1 as a `Call` (see _calls.py); the clients expose each as a method."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import BaseModel

from shared.client._calls import UNSET, Call, Unset, dump, fields, model, nothing, page, present, query
from shared.client.errors import InvalidRequest, is_replayed
from shared.client.models import (
    ApiKey,
    ApiKeyCreated,
    EntryHistory,
    EntryWrite,
    ExtractionStatus,
    GenerationAccepted,
    KnowledgeContext,
    KnowledgeResult,
    Memory,
    MemoryEntry,
    Page,
    Project,
    ToolResult,
    WriteStatus,
)
from shared.events import SourceType, WriteAction, WritePolicy
from shared.ids import IDEMPOTENCY_KEY

Json = Mapping[str, Any]


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
) -> Call[GenerationAccepted]:
    """Report a finished model turn for automatic extraction; `extraction_status` tells the outcome."""
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
    )
    return Call("POST", "/generations/completed", model(GenerationAccepted), body=body)


def extraction_status(generation_id: str, *, project_id: str | None = None) -> Call[ExtractionStatus]:
    path = f"/generations/{_id(generation_id)}/extraction"
    return Call("GET", path, model(ExtractionStatus), params=query(project_id=project_id))


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
